"""The alert rules of deploy/prometheus/ with Debian's promtool: `check rules` (they parse, their templates
render) and `test rules` (alerts_test.yaml: each alert pending, then firing with its labels and summary on
the series that should raise it, silent on the healthy ones beside them); every alert has a unit test."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from tests.tools import require_tool

PROMETHEUS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require_tool("promtool"), *args], cwd=PROMETHEUS, capture_output=True, text=True,
                          timeout=120)


def test_the_rules_pass_promtool_check() -> None:
    result = promtool("check", "rules", "alerts.yaml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_rules_pass_their_unit_tests() -> None:
    result = promtool("test", "rules", "alerts_test.yaml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_unit_test_that_sees_it_fire() -> None:
    groups = yaml.safe_load((PROMETHEUS / "alerts.yaml").read_text())["groups"]
    alerts = {rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule}
    assert {"LoraplaneEngineDown", "LoraplaneQueueSaturated", "LoraplaneRequestErrorRatio",
            "LoraplaneAdapterLoadFailures", "LoraplaneReconcileDrift", "LoraplaneHighTTFT"} <= alerts
    cases = [case for test in yaml.safe_load((PROMETHEUS / "alerts_test.yaml").read_text())["tests"]
             for case in test["alert_rule_test"]]
    assert alerts == {case["alertname"] for case in cases if case["exp_alerts"]}
    assert alerts == {case["alertname"] for case in cases if not case["exp_alerts"]}  # and sees it silent

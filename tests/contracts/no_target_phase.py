"""Imported by the contract runs' hooks: Hypothesis' `target` phase is left out of every schemathesis test.

The runs maximise nothing (no `--generation-maximize`), so that phase only hill-climbs on what schemathesis
reports internally, and Hypothesis 6.170's optimiser can crash there with an IndexError of its own
(`attempt.spans[j]`, seen once in three control-plane runs), failing a run that found nothing wrong.
"""

from __future__ import annotations

import hypothesis
from schemathesis.config._projects import ProjectConfig

_original = ProjectConfig.get_hypothesis_settings


def _without_target(self: ProjectConfig, **kwargs: object) -> hypothesis.settings:
    settings = _original(self, **kwargs)  # type: ignore[arg-type]
    return hypothesis.settings(settings, phases=[p for p in settings.phases if p is not hypothesis.Phase.target])


ProjectConfig.get_hypothesis_settings = _without_target  # type: ignore[method-assign]

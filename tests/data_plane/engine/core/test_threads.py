"""The engine core's threads and CPUs: leave the API process a CPU when there are few; say so when "auto"
binds a core to CPUs another engine core on the host is bound to."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from data_plane.config import ConfigError
from data_plane.engine.core.process import warn_if_cores_share
from data_plane.engine.core.threads import (
    CORE_MODULE,
    CORE_SPIN_COUNT,
    api_cpus,
    bound_engine_cores,
    core_cpus,
    core_environment,
    core_threads,
    parse_cpu_list,
)
from tests.data_plane.api.engines import engine_config


def test_cpu_lists_parse_as_vllm_writes_them():
    assert parse_cpu_list("1-3,5") == [1, 2, 3, 5]
    assert parse_cpu_list("2") == [2]
    for bad in ("", "3-1", "a", "-1"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_threads_default_to_every_cpu_and_leave_the_api_one_from_four_up():
    assert core_threads(None, [0, 1]) == 2  # measured: both threads beat one bound beside the API
    assert core_threads(None, [0]) == 1
    assert core_threads(None, [0, 1, 2, 3]) == 3
    assert core_threads(None, list(range(8))) == 7
    assert core_threads(1, [0, 1]) == 1


def test_auto_binds_only_when_a_cpu_is_left_for_the_api():
    assert core_cpus("auto", 1, [0, 1]) == [1]
    assert core_cpus("auto", 2, [0, 1]) is None
    assert core_cpus("auto", 3, [0, 1, 2, 3]) == [1, 2, 3]
    assert core_cpus("nobind", 1, [0, 1]) is None
    assert core_cpus("0-1", 1, [0, 1, 2]) == [0, 1]


def test_the_operator_s_openmp_settings_win():
    # libgomp's wait policy, with its spin shortened (a spinning worker held the CPU the API needed)
    assert core_environment({}, 3) == {"OMP_NUM_THREADS": "3", "GOMP_SPINCOUNT": CORE_SPIN_COUNT}
    assert core_environment({"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}, 2) == {
        "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}
    assert core_environment({"OMP_WAIT_POLICY": ""}, 2) == {"OMP_WAIT_POLICY": "", "OMP_NUM_THREADS": "2"}
    assert core_environment({"GOMP_SPINCOUNT": "100000"}, 2) == {"GOMP_SPINCOUNT": "100000", "OMP_NUM_THREADS": "2"}


def test_the_config_refuses_a_bad_bind(demo_model_dir):
    with pytest.raises(ConfigError, match="omp-threads-bind"):
        engine_config(demo_model_dir, omp_threads_bind="cores 1 to 3")
    assert engine_config(demo_model_dir, omp_threads_bind="1-3,5").omp_threads_bind == "1-3,5"


def test_the_api_process_keeps_off_the_cpus_auto_gave_the_core():
    assert api_cpus("auto", [1], [0, 1]) == [0]
    assert api_cpus("auto", [2, 3], [0, 1, 2, 3]) == [0, 1]
    assert api_cpus("auto", None, [0, 1]) is None  # the core was not bound: neither is the API
    assert api_cpus("1", [1], [0, 1]) is None  # an explicit list binds the core only


@pytest.fixture
def bound_core():
    """A process that looks like an engine core (its command line names the core's module), bound to the
    last CPU this process may use; (pid, that CPU, every CPU). Needs two CPUs to tell bound from free."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs at least two CPUs")
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", CORE_MODULE])
    try:
        os.sched_setaffinity(process.pid, {cpus[-1]})
        yield process.pid, cpus[-1], cpus
    finally:
        process.kill()
        process.wait()


def test_engine_cores_bound_to_fewer_cpus_are_found(bound_core):
    pid, last, cpus = bound_core
    free = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", CORE_MODULE])  # unbound
    try:
        found = bound_engine_cores(cpus)
    finally:
        free.kill()
        free.wait()
    assert found.get(pid) == {last}
    assert free.pid not in found


def test_auto_warns_when_another_core_is_bound_to_its_cpus(bound_core):
    pid, last, cpus = bound_core
    assert warn_if_cores_share([cpus[0]], cpus) is None  # another CPU: nothing shared
    # the message logged, checked as returned (in one full-suite run the record never reached caplog)
    warning = warn_if_cores_share([last], cpus)
    assert warning is not None and f"{pid}: [{last}]" in warning and "--omp-threads-bind" in warning

"""autopar.calibrate: links fitted per mesh axis on the devices at hand, profiles as JSON."""
import json

import jax
import models
import pytest
from helpers import check_against_single_device

import autopar
from autopar.cost.calibrate import KINDS, Sample, calibrate, fit, measure
from autopar.cost.hardware import (PROFILES, Hardware, Link, LinkLevel, axis_links, get_profile,
                                   load_hardware)
from autopar.cost.model import collective_time
from autopar.mesh import MeshShape

MESH = {"data": 2, "model": 4}


@pytest.fixture(scope="module")
def calibration():
    return measure(autopar.make_mesh(MESH), progress=False)


@pytest.mark.slow
def test_every_axis_gets_a_positive_link_of_its_own(calibration):
    hw = calibration.hardware
    assert hw.name == "calibrated" and hw.platform == "cpu"
    assert set(calibration.axis_fits) == set(MESH)
    links = axis_links(hw, MeshShape(tuple(MESH), tuple(MESH.values())))
    for axis, link in zip(MESH, links):
        f = calibration.axis_fits[axis]
        assert f.latency > 0 and f.bandwidth > 0
        assert link == Link(f.latency, f.bandwidth), "each axis sits on its own measured level"
    fastest = max(calibration.axis_fits.values(), key=lambda f: f.bandwidth)
    assert (hw.link_latency, hw.link_bandwidth) == (fastest.latency, fastest.bandwidth)
    assert all(f.latency > 0 and f.bandwidth > 0 for f in calibration.kind_fits.values())
    assert hw.flops == max(calibration.flops.values()) > 0 and hw.memory_bandwidth > 0
    assert "cpu" in hw.source and jax.__version__ in hw.source


@pytest.mark.slow
def test_measured_times_grow_with_message_size(calibration):
    # 1,000 times the bytes: a collective whose time does not grow was not timed at all
    for axis in MESH:
        for kind in KINDS:
            times = [s.seconds for s in calibration.samples if (s.axis, s.kind) == (axis, kind)]
            assert len(times) == 4 and times[-1] > times[0], (axis, kind, times)


def test_fit_recovers_the_cost_models_own_alpha_and_beta():
    link, n = Link(3e-5, 2e9), 4
    samples = [Sample("x", kind, b, result, collective_time(kind, result, n, link) + 1e-5)
               for kind in KINDS for b in (2**12, 2**16, 2**20)
               for result in [{"all-gather": n * b, "reduce-scatter": b // n}.get(kind, b)]]
    got = fit(samples, n, launch=1e-5)  # the launch is taken off alpha
    assert got.latency == pytest.approx(link.latency, rel=1e-6)
    assert got.bandwidth == pytest.approx(link.bandwidth, rel=1e-6)
    assert got.note == ""


def test_noise_falls_back_to_positive_values_and_says_so():
    shrinking = [Sample("x", "all-reduce", b, b, t) for b, t in ((4096, 2e-3), (2**20, 1e-3))]
    got = fit(shrinking, 2, launch=0.0)
    assert got.latency > 0 and got.bandwidth > 0 and "did not grow" in got.note
    no_latency = [Sample("x", "all-reduce", b, b, b / 1e9) for b in (4096, 2**20)]
    got = fit(no_latency, 2, launch=1e-4)
    assert got.bandwidth == pytest.approx(1e9, rel=1e-6)
    assert got.latency == PROFILES["cpu"].link_latency and "default profile" in got.note


def test_json_round_trip_and_get_profile_by_path(calibration, tmp_path):
    hw = calibration.hardware
    assert Hardware.from_json(hw.to_json()) == hw
    path = tmp_path / "calibrated.json"
    hw.save(path)
    assert load_hardware(path) == hw
    assert get_profile(path) == hw and get_profile(str(path)) == hw
    for name, profile in PROFILES.items():  # levels and platforms of the datasheet ones too
        assert Hardware.from_json(profile.to_json()) == profile
        assert get_profile(name) is profile


def test_bad_profiles_name_the_path_and_the_fix(tmp_path):
    with pytest.raises(autopar.AutoparError, match=r"missing\.json.*Fix:"):
        get_profile(str(tmp_path / "missing.json"))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(autopar.AutoparError, match=r"broken\.json.*Fix:"):
        get_profile(broken)
    partial = tmp_path / "partial.json"
    body = json.loads(PROFILES["a100"].to_json())
    del body["flops"]
    partial.write_text(json.dumps(body))
    with pytest.raises(autopar.AutoparError, match=r"partial\.json.*flops.*Fix:"):
        get_profile(str(partial))
    with pytest.raises(autopar.AutoparError, match=r"unknown hardware profile.*'a100'"):
        get_profile("no_such_chip")


@pytest.mark.slow
def test_calibrate_saves_on_process_zero_and_shows_progress(tmp_path, capsys):
    mesh = autopar.make_mesh({"data": 2}, devices=jax.devices()[:2])
    path = tmp_path / "two.json"
    hw = calibrate(mesh, sizes=(4096, 2**18), repeats=2, dtypes=("float32",), path=path)
    assert load_hardware(path) == hw and hw.axis_levels == (("data", "axis:data"),)
    assert hw.levels == (LinkLevel("axis:data", 0, hw.link_bandwidth, hw.link_latency),)
    assert "[calibrate] data all-gather 256 KiB" in capsys.readouterr().err
    calibrate(mesh, sizes=(4096, 8192), repeats=1, dtypes=("float32",), progress=False)
    assert capsys.readouterr().err == ""


def test_bad_calibration_arguments():
    with pytest.raises(autopar.AutoparError, match="Mesh.*Fix:"):
        calibrate({"data": 8})
    mesh = autopar.make_mesh({"data": 2}, devices=jax.devices()[:2])
    with pytest.raises(autopar.AutoparError, match="Fix:"):
        calibrate(mesh, sizes=(4096,))
    with pytest.raises(autopar.AutoparError, match="Fix:"):
        calibrate(mesh, dtypes=("int32",))


@pytest.mark.slow
def test_a_plan_on_the_calibrated_profile_trains_like_one_device(calibration):
    step, state, batch = models.mlp_setup()
    plan = check_against_single_device(step, state, batch, autopar.make_mesh(MESH),
                                       hardware=calibration.hardware)
    assert plan.hardware == "calibrated" and plan.cost["total_s"] > 0

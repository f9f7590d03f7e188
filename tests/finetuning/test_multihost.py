"""`pockjax finetune` over two processes (JAX's distributed runtime, gloo collectives on
CPU), each with 2 devices: the run one process with 4 devices makes, one run folder
written by process 0; one process killed outright stops the other within a minute, and
`--resume` on both ends bit for bit where an uninterrupted run ends."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
from safetensors.numpy import load_file

from tests.finetuning.test_finetune import ROOT
from tests.finetuning.test_mesh import setup  # noqa: F401  (the fixture)


def _args(setup, out, steps):
    return ["--model", setup["model"], "--data", setup["data"], "--valid", setup["valid"],
            "--scheme", "paper", "--steps", steps, "--batch", 4, "--seq", 24, "--lr", 1e-3,
            "--save-every", 5, "--keep", 2, "--seed", 3, "--no-plot", "--out", out]


def _env(devices):
    return {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _start(setup, out, steps, logs, *extra):
    port = _free_port()
    procs = []
    for i in range(2):
        with open(logs / f"p{i}.txt", "w") as err:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "pockjax.cli", "finetune",
                 *map(str, _args(setup, out, steps)), "--coordinator", f"localhost:{port}",
                 "--num-processes", "2", "--process-id", str(i), *extra],
                cwd=ROOT, env=_env(2), stdout=subprocess.DEVNULL, stderr=err))
    return procs


def _wait(procs, timeout):
    """Wait for every process (raising on a timeout), and kill any left after."""
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            p.kill()


def _finish(procs, logs, timeout=300):
    _wait(procs, timeout)
    for i, p in enumerate(procs):
        assert p.returncode == 0, (logs / f"p{i}.txt").read_text()[-3000:]


def _records(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_processes_train_as_one_process_with_four_devices(setup, tmp_path):
    one = tmp_path / "one"
    done = subprocess.run([sys.executable, "-m", "pockjax.cli", "finetune",
                           *map(str, _args(setup, one, 8)), "--mesh", "data=4"],
                          cwd=ROOT, env=_env(4), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    two = tmp_path / "two"
    _finish(_start(setup, two, 8, tmp_path), tmp_path)
    said = (tmp_path / "p0.txt").read_text()
    assert "process 0 of 2: 2 of the 4 cpu devices here; process 0 writes" in said
    assert "mesh data=4 on 4 cpu devices" in said
    assert "pockjax finetune:" not in (tmp_path / "p1.txt").read_text()  # one log
    a, b = _records(one), _records(two)
    assert [r["step"] for r in b if "loss" in r] == list(range(1, 9))  # each step once
    np.testing.assert_allclose([r["loss"] for r in b if "loss" in r],
                               [r["loss"] for r in a if "loss" in r], rtol=0, atol=1e-5)
    np.testing.assert_allclose([r["valid_loss"] for r in b if "valid_loss" in r],
                               [r["valid_loss"] for r in a if "valid_loss" in r], atol=1e-5)
    want, got = (load_file(str(p / "final" / "model.safetensors")) for p in (one, two))
    base = load_file(str(setup["model"] / "model.safetensors"))
    for k, w in want.items():
        moved = np.linalg.norm(w - base[k])
        assert np.linalg.norm(got[k] - w) <= 1e-3 * moved, k
        if moved == 0:
            np.testing.assert_array_equal(got[k], base[k], err_msg=k)
    assert json.loads((two / "run.json").read_text())["processes"] == 2
    assert sorted(p.name for p in (two / "checkpoints").glob("*")) == [
        "step-00000005.safetensors", "step-00000008.safetensors"]


def test_kill_9_of_one_process_stops_the_other_and_resume_ends_bit_for_bit(setup, tmp_path):
    (tmp_path / "whole-logs").mkdir()
    whole = tmp_path / "whole"
    _finish(_start(setup, whole, 30, tmp_path / "whole-logs"), tmp_path / "whole-logs")
    cut = tmp_path / "cut"
    procs = _start(setup, cut, 30, tmp_path)
    deadline = time.time() + 300
    while time.time() < deadline and not (cut / "checkpoints" / "step-00000010.safetensors"
                                          ).exists():
        time.sleep(0.02)
    procs[1].kill()  # kill -9
    began = time.time()
    try:
        procs[0].wait(timeout=60)  # the other stops within a minute: no hang
    finally:
        for p in procs:
            p.kill()
    assert time.time() - began < 60 and procs[0].returncode in (1, -6)
    assert not (cut / "final").exists()
    err = (tmp_path / "p0.txt").read_text()
    if procs[0].returncode == 1:  # the step's collective failed: pockjax says so
        kept = sorted(p.name for p in (cut / "checkpoints").glob("step-*.safetensors"))[-1]
        assert err.rstrip().endswith(
            f"the last complete checkpoint is {kept} (step {int(kept[5:13])}). Start every "
            f"process again with the same command and --resume"), err[-3000:]
        assert "process 0 of 2: another process of the run stopped" in err
        assert "Traceback" not in err and "Terminating process" not in err
    else:  # JAX's heartbeat noticed first: its runtime aborted the process itself
        assert "This most likely indicates that another task died" in err, err[-3000:]
    # --resume on both: from the last complete checkpoint to where the whole run ends
    _finish(_start(setup, cut, 30, tmp_path, "--resume"), tmp_path)
    assert "resumed from step-" in (tmp_path / "p0.txt").read_text()
    a, b = (load_file(str(p / "final" / "model.safetensors")) for p in (whole, cut))
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert [r["step"] for r in _records(cut) if "loss" in r] == list(range(1, 31))


def test_one_process_in_a_batch_scripts_allocation_runs_alone(monkeypatch):
    """A SLURM batch script's allocation of several tasks, with pockjax started once in
    it (not under srun): one process, no wait for others that never come."""
    from pockjax.finetuning._hosts import join

    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_JOB_ID", "17")
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS", raising=False)
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE", raising=False)
    assert join(None, None, None) is None


def test_only_a_lost_process_is_reported_as_one():
    """`Hosts.lost`: the runtime's errors that say another process is gone become
    `ProcessLost` naming the last complete checkpoint; any other error stays itself."""
    from pathlib import Path

    from pockjax.finetuning import ProcessLost
    from pockjax.finetuning._hosts import Hosts

    hosts = Hosts(1, 3)
    assert hosts.lost(RuntimeError("RESOURCE_EXHAUSTED: out of memory"), []) is None
    gloo = RuntimeError("UNKNOWN: Gloo all-reduce failed: [pair.cc:547] Connection closed "
                        "by peer [127.0.0.1]:13728\nmore lines")
    said = hosts.lost(gloo, [])
    assert isinstance(said, ProcessLost) and str(said) == (
        "process 1 of 3: another process of the run stopped (the step's collective failed: "
        "UNKNOWN: Gloo all-reduce failed: [pair.cc:547] Connection closed by peer "
        "[127.0.0.1]:13728); no checkpoint was written yet. Start every process again with "
        "the same command and --resume")
    kept = [(5, Path("c/step-00000005.safetensors")), (10, Path("c/step-00000010.safetensors"))]
    assert "the last complete checkpoint is step-00000010.safetensors (step 10)." in str(
        hosts.lost(RuntimeError("UNAVAILABLE: The following tasks are unhealthy"), kept))


def test_sigterm_to_one_process_stops_every_process_after_one_step_and_resume_ends_bit_for_bit(
        setup, tmp_path):
    """A scheduler's SIGTERM reaches the processes at different moments; here process 0
    alone gets one. Every process stops after the same step, the checkpoint of that step
    is saved once, each exits with 143; `--resume` on both ends bit for bit where an
    uninterrupted run ends. Before the processes agreed on the step (with process 1's
    SIGTERM 0.5 s after process 0's), process 0 waited in its checkpoint's gather and
    process 1 in its next step, both until killed."""
    import signal

    (tmp_path / "whole-logs").mkdir()
    whole = tmp_path / "whole"
    _finish(_start(setup, whole, 30, tmp_path / "whole-logs"), tmp_path / "whole-logs")
    cut = tmp_path / "cut"
    procs = _start(setup, cut, 30, tmp_path, "--save-every", "100")
    deadline = time.time() + 300
    while time.time() < deadline and not ((cut / "metrics.jsonl").exists() and sum(
            '"loss"' in x for x in (cut / "metrics.jsonl").read_text().splitlines()) >= 3):
        time.sleep(0.02)
    procs[0].send_signal(signal.SIGTERM)
    _wait(procs, 60)
    logs = [(tmp_path / f"p{i}.txt").read_text() for i in range(2)]
    assert [p.returncode for p in procs] == [143, 143], [x[-2000:] for x in logs]
    saved = sorted((cut / "checkpoints").glob("step-*.safetensors"))
    assert len(saved) == 1, saved
    stopped = int(saved[0].name[5:13])
    assert 3 <= stopped < 30
    assert [r["step"] for r in _records(cut) if "loss" in r] == list(range(1, stopped + 1))
    _finish(_start(setup, cut, 30, tmp_path, "--resume"), tmp_path)
    a, b = (load_file(str(p / "final" / "model.safetensors")) for p in (whole, cut))
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert [r["step"] for r in _records(cut) if "loss" in r] == list(range(1, 31))

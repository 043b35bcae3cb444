"""NCCL's Flight Recorder in hang reports (lightning_3d.faults.flight_recorder), checked on CPU without NCCL:
the variables are decided and set before the process group is created, the user's own are kept, the hang
report names the dump file, and gloo runs see none of it."""

import os
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_3d.faults import flight_recorder as fr
from lightning_3d.faults.flight_recorder import FlightRecorder, enable_flight_recorder, flight_recorder_settings
from lightning_3d.faults.watch import FaultWatch, Phase
from lightning_3d.strategies import processes

ALL_NAMES = fr.BUFFER_SIZE + fr.DUMP_ON_TIMEOUT + fr.DUMP_FILE + fr.DUMP_PIPE


@pytest.mark.parametrize("backend", ["nccl", "cuda:nccl,cpu:gloo"])
def test_nccl_turns_on_the_trace_buffer_the_dump_on_timeout_a_dump_file_per_job_and_a_dump_pipe(backend):
    settings = flight_recorder_settings(backend, {"TORCHELASTIC_RUN_ID": "abc"}, pid=42)
    assert settings["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert settings["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    dump_dir = os.path.expanduser(os.path.join("~", ".cache", "torch", "lightning_3d_flight_recorder", "run_abc"))
    assert settings["TORCH_FR_DUMP_TEMP_FILE"] == os.path.join(dump_dir, "rank_")
    assert settings["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"].endswith("lightning_3d_flight_recorder_42_rank_")
    # One directory per job, the same on every rank of it, from what the launcher gives them all.
    assert flight_recorder_settings("nccl", {"SLURM_JOB_ID": "7"}, pid=1)["TORCH_FR_DUMP_TEMP_FILE"].endswith(
        os.path.join("slurm_7", "rank_"))
    assert flight_recorder_settings("nccl", {"MASTER_PORT": "29500"}, pid=1)["TORCH_FR_DUMP_TEMP_FILE"].endswith(
        os.path.join("port_29500", "rank_"))


def test_the_users_own_settings_are_kept_under_either_of_torchs_names():
    users = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
             "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/shared/fr/trace_", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": "/run/p_"}
    assert flight_recorder_settings("nccl", users, pid=1) == {}
    environ = dict(users)
    assert enable_flight_recorder("nccl", environ) == {} and environ == users
    recorder = FlightRecorder.of("nccl", 3, users)
    assert (recorder.dump_path, recorder.pipe_path) == ("/shared/fr/trace_3", "/run/p_3.pipe")
    # torch prefers TORCH_FR_*: with both set, its file is the one named.
    assert FlightRecorder.of("nccl", 3, {**users, "TORCH_FR_DUMP_TEMP_FILE": "/x/r_"}).dump_path == "/x/r_3"
    only_buffer = flight_recorder_settings("nccl", {"TORCH_FR_BUFFER_SIZE": "10"}, pid=1)
    assert "TORCH_FR_BUFFER_SIZE" not in only_buffer and "TORCH_NCCL_DUMP_ON_TIMEOUT" in only_buffer


def _environment_at_init(monkeypatch, tmp_path, backend: str) -> tuple[dict, dict]:
    for name in ALL_NAMES + ("TORCHELASTIC_USE_AGENT_STORE", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test_flight_recorder")
    monkeypatch.setenv("HOME", str(tmp_path))  # the dump directory goes under ~/.cache/torch
    before, seen = dict(os.environ), {}
    # Instead of creating the process group: what it would read from the environment when created.
    monkeypatch.setattr(processes, "_init_dist_connection", lambda *args, **kwargs: seen.update(os.environ))
    try:
        processes.init_process_group(object(), backend, timedelta(seconds=60), torch.device("cpu"))
    finally:  # the settings go, for the tests that come after in this process
        for name in set(os.environ) - set(before):
            del os.environ[name]
    return before, seen


def test_on_nccl_the_environment_has_the_settings_when_the_process_group_is_created(monkeypatch, tmp_path):
    before, seen = _environment_at_init(monkeypatch, tmp_path, "nccl")
    added = {k: v for k, v in seen.items() if before.get(k) != v}
    assert set(added) == {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE",
                          "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"}, added
    assert os.path.isdir(os.path.dirname(added["TORCH_FR_DUMP_TEMP_FILE"]))  # torch does not create it


def test_gloo_gets_no_settings_and_no_flight_recorder(monkeypatch, tmp_path):
    before, seen = _environment_at_init(monkeypatch, tmp_path, "gloo")
    assert seen == before
    assert FlightRecorder.of("gloo", 0, {}) is None and flight_recorder_settings("gloo", {}, pid=1) == {}


def _hang_report(capfd, recorder) -> str:
    watch = FaultWatch(dist.HashStore(), 0, 1, lambda r: f"rank {r}", Phase("training", 1.0, "hang_timeout"),
                       exit_timeout_s=1.0, flight_recorder=recorder)
    exits = []
    watch._exit = lambda report, printed=False: exits.append(report)  # instead of ending this process
    watch._report_hang(None, 1.5, watch.phase, "training_step started", store_ok=True)
    assert exits, "the hang did not end the rank"
    return capfd.readouterr().err


def test_a_hang_report_on_nccl_asks_for_the_dump_and_names_its_file(tmp_path, capfd):
    recorder = FlightRecorder.of("nccl", 5, {"TORCH_FR_DUMP_TEMP_FILE": f"{tmp_path}/rank_",
                                             "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": f"{tmp_path}/pipe_",
                                             "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "5000"})
    # NCCL's monitor thread, as torch 2.13 runs it: a fifo named pipe + rank + ".pipe"; a write to it makes it
    # write the dump to the prefix + rank.
    os.mkfifo(recorder.pipe_path)
    reader = os.open(recorder.pipe_path, os.O_RDONLY | os.O_NONBLOCK)

    def monitor():
        for _ in range(200):
            try:
                if os.read(reader, 128):
                    with open(recorder.dump_path, "wb") as f:
                        f.write(b"entries")
                    return
            except BlockingIOError:
                pass
            threading.Event().wait(0.02)

    thread = threading.Thread(target=monitor)
    thread.start()
    try:
        stderr = _hang_report(capfd, recorder)
    finally:
        thread.join()
        os.close(reader)
    assert f"NCCL Flight Recorder: this rank's last collectives are in {tmp_path}/rank_5." in stderr, stderr
    assert f"torchfrtrace {tmp_path} --prefix rank_" in stderr, stderr
    assert "Python stack of the main thread" in stderr  # the Python report is still there


def test_a_hang_report_on_nccl_says_when_no_dump_came(tmp_path, capfd):
    recorder = FlightRecorder.of("nccl", 2, {"TORCH_FR_DUMP_TEMP_FILE": f"{tmp_path}/rank_",
                                             "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": f"{tmp_path}/pipe_"})
    stderr = _hang_report(capfd, recorder)  # no pipe: NCCL's monitor never started
    assert f"could not ask it to dump through {tmp_path}/pipe_2.pipe" in stderr, stderr
    assert f"NCCL dumps to {tmp_path}/rank_2 when a collective times out" in stderr, stderr


def test_a_hang_report_on_gloo_has_no_flight_recorder_line(capfd):
    stderr = _hang_report(capfd, FlightRecorder.of("gloo", 0, os.environ))
    assert "made no progress for 1.5 s" in stderr and "Flight Recorder" not in stderr, stderr

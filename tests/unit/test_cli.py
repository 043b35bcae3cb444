"""The ``lightning-3d`` console script in one process: example configs parse and interpolate, bad input gets the
parser's error, the dry run reports without starting a process (its runs on ranks: launch/test_cli_launch.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parents[2]
CONFIGS = sorted((ROOT / "example_configs").glob("*.yaml"))


def _print_config(*args: str, capsys) -> str:
    """``lightning-3d fit ARGS --print_config`` in this process (the same ``main``, without a new interpreter
    importing torch and Lightning per config): the printed YAML."""
    from lightning_3d.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *args, "--print_config"])
    out, err = capsys.readouterr()
    assert exit_info.value.code in (0, None), err[-3000:]
    return out


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_example_config_prints_a_complete_resolved_config(config, capsys):
    printed = yaml.safe_load(_print_config("--config", str(config), capsys=capsys))
    assert printed["trainer"]["strategy"]["class_path"] == "lightning_3d.ThreeDStrategy"
    # omegaconf interpolation resolved: the data's vocabulary is the model's
    assert printed["data"]["init_args"]["vocab_size"] == printed["model"]["init_args"]["config"]["vocab_size"]


GPU_CONFIGS = [c for c in CONFIGS if "gpu" in c.name]


@pytest.mark.parametrize("config", GPU_CONFIGS, ids=[c.name for c in GPU_CONFIGS])
def test_gpu_config_builds_a_consistent_layout_and_its_monitors_without_a_gpu(config, tmp_path, monkeypatch):
    """What can be checked of a GPU config on a CPU machine: its objects build (accelerator switched to cpu),
    its layout fits its world, and the model's sizes divide as tp, pp and the micro-batches need."""
    from lightning_3d.cli import build_cli
    from lightning_3d.parallel.dims import ParallelDims

    monkeypatch.chdir(tmp_path)
    cli = build_cli(["--config", str(config), "--trainer.accelerator=cpu", "--trainer.logger=false"], run=False)
    trainer, strategy, gpt = cli.trainer, cli.trainer.strategy, cli.model.config
    assert trainer.precision == "bf16-mixed"
    monitors = {type(c).__name__ for c in trainer.callbacks}
    assert {"GradNormMonitor", "NaNGuard", "ThroughputMonitor", "CommTimer", "PipelineMonitor",
            "ModelCheckpoint"} <= monitors
    parallel = strategy.parallel_config
    dims = ParallelDims.from_config(parallel, len(strategy.parallel_devices) * trainer.num_nodes)
    assert len(strategy.parallel_devices) % dims.tp == 0, "a tp group must stay inside one node"
    assert gpt.n_head % dims.tp == 0 and gpt.vocab_size % dims.tp == 0 and gpt.block_size % dims.tp == 0
    assert gpt.n_layer % (dims.pp * parallel.virtual_pipeline_size) == 0
    assert cli.datamodule.hparams.batch_size % parallel.num_microbatches == 0
    assert parallel.activation_checkpointing and (parallel.zero_stage > 0 or dims.dp == 1)


def test_strategy_can_be_given_by_its_registered_name(capsys):
    config = ROOT / "example_configs" / "gpt_tiny_dp_cpu.yaml"
    printed = _print_config("--config", str(config), "--trainer.strategy=3d", capsys=capsys)
    assert yaml.safe_load(printed)["trainer"]["strategy"] == "3d"


# ---------------------------------------------------------------------------------------------- bad input


def _config_with(tmp_path, old: str, new: str) -> Path:
    text = (ROOT / "example_configs" / "gpt_tiny_dp_cpu.yaml").read_text()
    assert old in text
    path = tmp_path / "bad.yaml"
    path.write_text(text.replace(old, new))
    return path


@pytest.mark.parametrize("old, new, expected", [
    ("n_layer: 4", "n_layr: 4", ["Option 'n_layr' is not accepted"]),
    ("max_steps: 300", "max_steps: lots", ['Parser key "trainer.max_steps"', "Expected a <class 'int'>", "lots"]),
], ids=["unknown_key", "wrong_type"])
def test_bad_yaml_gets_the_parsers_error_not_a_traceback(tmp_path, capsys, old, new, expected):
    from lightning_3d.cli import main

    with pytest.raises(SystemExit) as exit_info:  # jsonargparse's parser.error: usage, message, exit 2
        main(["fit", "--config", str(_config_with(tmp_path, old, new)), "--print_config"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert all(text in err for text in expected), err[-3000:]
    assert "lightning-3d fit --help" in err


def test_missing_config_file_is_named(tmp_path, capsys):
    from lightning_3d.cli import main

    missing = tmp_path / "no_such.yaml"
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(missing)])
    assert exit_info.value.code == 2
    assert f"File does not exist: '{missing}'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- a newcomer's run


def test_console_script_finds_the_users_module_in_the_current_directory(tmp_path):
    """`lightning-3d fit --model mypkg.MyModule` from the user's project folder, as `python -m` would."""
    script = Path(sys.executable).parent / "lightning-3d"
    if not script.exists():
        pytest.skip(f"the console script is not installed next to {sys.executable}")
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text(
        "from lightning_3d.models import GPTLightningModule\n\n\nclass MyModule(GPTLightningModule):\n    pass\n")
    config = ROOT / "example_configs" / "gpt_tiny_dp_cpu.yaml"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(script), "fit", "--config", str(config), "--model", "mypkg.MyModule", "--print_config"],
                          env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert yaml.safe_load(proc.stdout)["model"]["class_path"] == "mypkg.MyModule"


def test_a_layout_the_devices_cannot_hold_fails_before_any_process_starts(monkeypatch, capsys):
    """dp 8 x tp 8 x pp 4 = 256 on devices=64: one line from the launching process, in seconds, and no
    process started (were one started, the launcher's spawn below fails the test instead)."""
    import time

    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    from lightning_3d.cli import main

    def spawn(self):
        raise AssertionError("the launcher started processes")

    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", spawn)
    config = ROOT / "example_configs" / "gpt_tiny_3d_cpu.yaml"
    # CPU seconds of this process (parsing and Trainer(...)): the machines running the suite are shared, so
    # their wall time says more about the other jobs. Spawning 64 ranks took minutes.
    start = time.process_time()
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--trainer.devices=64", "--trainer.logger=false",
              "--trainer.strategy.init_args.data_parallel_size=8", "--trainer.strategy.init_args.tensor_parallel_size=8",
              "--trainer.strategy.init_args.pipeline_parallel_size=4"])
    seconds = time.process_time() - start
    assert str(exit_info.value.code).startswith(
        "lightning-3d: error on rank 0: data_parallel_size (8) * pipeline_parallel_size (4) * tensor_parallel_size"
        " (8) = 256, but the world size is 64"), exit_info.value.code
    assert seconds < 5, f"took {seconds:.1f} CPU seconds"


# ---------------------------------------------------------------------------------------------- dry run


@pytest.fixture
def no_process_starts(monkeypatch):
    """Starting a rank or a process group fails the test: Lightning's launcher, torch.distributed, Popen."""
    import torch.distributed
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    def started(*args, **kwargs):
        raise AssertionError("the dry run started a process or a process group")

    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", started)
    monkeypatch.setattr(torch.distributed, "init_process_group", started)
    monkeypatch.setattr(subprocess, "Popen", started)


def _dry_run(*args: str, capsys) -> tuple[str, object, float]:
    """``lightning-3d fit --config gpt_tiny_3d_cpu.yaml ARGS --dry_run`` in this process: what it printed, its
    exit code (None: it returned) and its CPU seconds (the suite's machines are shared; wall time says more
    about the other jobs)."""
    import time

    from lightning_3d.cli import main

    config = ROOT / "example_configs" / "gpt_tiny_3d_cpu.yaml"
    start = time.process_time()
    try:
        main(["fit", "--config", str(config), "--trainer.logger=false", *args])
        code = None
    except SystemExit as exit_info:
        code = exit_info.code
    return capsys.readouterr().out, code, time.process_time() - start


def test_dry_run_prints_the_layout_stages_and_memory_per_rank_without_starting_a_process(no_process_starts, capsys):
    out, code, seconds = _dry_run("--dry_run", capsys=capsys)
    assert code is None, code
    assert "dp=2 x pp=2 x tp=2 = 8 ranks, 8 per node x 1 node(s), on cpu" in out, out
    assert "stage 0 on ranks 0-3: 2 blocks model.blocks.0-1 + model.tok_emb" in out, out
    assert "stage 1 on ranks 4-7: 2 blocks model.blocks.2-3 + model.ln_f, model.lm_head" in out, out
    # One row per pipeline rank: parameters, gradients, optimizer, activations, transient, total (MiB). The
    # planner's model of this GPT (4 blocks of ~50k parameters, plus embeddings or head, split over tp=2): each
    # rank holds about half of its stage's ~105k parameters, 4 bytes each in fp32 -> ~0.2 MiB; AdamW 8 bytes.
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in out.splitlines()
            if line.strip().startswith(("0-3 ", "4-7 "))}
    assert set(rows) == {"0-3", "4-7"}, out
    for ranks, (params, grads, optimizer, activations, transient, total) in rows.items():
        assert 0.15 < params < 0.25 and grads == params and optimizer == pytest.approx(2 * params, abs=0.011), out
        assert activations > 0 and total == pytest.approx(params + grads + optimizer + activations + transient,
                                                          abs=0.03), out
    assert rows["0-3"][3] > rows["4-7"][3], "1F1B keeps more micro-batches in flight on the first stage"
    assert seconds < 10, f"took {seconds:.1f} CPU seconds"


def test_dry_run_of_a_layout_the_devices_cannot_hold_gives_the_real_runs_error(no_process_starts, capsys):
    """dp * pp * tp must be the world: the dry run exits with the very line a real run gives."""
    bad = ["--trainer.devices=6"]  # pp 2 * tp 2 = 4 does not divide 6
    _, dry, _ = _dry_run(*bad, "--dry_run", capsys=capsys)
    _, real, _ = _dry_run(*bad, capsys=capsys)  # a real run: fails at Trainer(...), before its launcher starts
    assert dry == real and str(dry).startswith(
        "lightning-3d: error on rank 0: pipeline_parallel_size (2) * tensor_parallel_size (2) = 4 does not divide"
        " the world size 6"), (dry, real)
    # What a rank finds in set-up (the policy's plan): reported by the dry run, in one line, before any rank.
    _, code, _ = _dry_run("--trainer.strategy.init_args.tensor_parallel_size=8",
                          "--trainer.strategy.init_args.pipeline_parallel_size=1", "--dry_run", capsys=capsys)
    assert str(code).startswith("lightning-3d: error (dry run): LayoutError: GPTConfig does not fit the layout:"
                                " n_head (4) is not divisible by tensor_parallel_size (8)"), code


def test_dry_run_of_layout_auto_shows_the_planners_choice_and_says_it_is_not_calibrated(no_process_starts, capsys):
    """issue 31: `--trainer.strategy.layout auto` from the command line; the dry run shows the choice on assumed
    speeds (the run itself times its devices first), then the stages and memory of the chosen layout."""
    out, code, _ = _dry_run("--trainer.strategy.init_args.layout=auto",
                            "--trainer.strategy.init_args.tensor_parallel_size=1",
                            "--trainer.strategy.init_args.pipeline_parallel_size=1",
                            "--trainer.strategy.init_args.sequence_parallel=false", "--dry_run", capsys=capsys)
    assert code is None, code
    assert "layout='auto' chose " in out and "(not calibrated: assumed speeds)" in out, out
    assert out.count(" ms predicted,") == 3 and "  why: " in out, out
    chosen = next(line for line in out.splitlines() if "layout='auto' chose" in line).split(" chose ")[1]
    dp, tp, pp = (int(part[2:]) for part in chosen.split()[:3])
    assert f"dp={dp} x pp={pp} x tp={tp} = 8 ranks" in out, out  # the rest of the report is of that layout


def test_dry_run_of_hsdp_shows_replicas_and_shards_and_the_memory_of_a_shard_group(no_process_starts, capsys):
    """issue 32: data_parallel_shard_size from the CLI; ZeRO's states per rank divide by the shard group (2
    ranks), not all of dp (4): twice those of ZeRO over all of dp."""
    layout = ["--trainer.strategy.init_args.pipeline_parallel_size=1", "--trainer.strategy.init_args.zero_stage=3"]
    rows = {}
    for shard in ("2", "auto"):
        out, code, _ = _dry_run(*layout, f"--trainer.strategy.init_args.data_parallel_shard_size={shard}",
                                "--dry_run", capsys=capsys)
        assert code is None, code
        rows[shard] = next([float(v) for v in line.split()[1:4]] for line in out.splitlines()
                           if line.strip().startswith("0-7 "))
        if shard == "2":
            assert "dp=4 (2 replicas x 2 shards) x pp=1 x tp=2 = 8 ranks" in out, out
            assert "HSDP: ZeRO over 2 dp ranks, 2 replicas" in out, out
    for hsdp, fsdp in zip(rows["2"], rows["auto"]):  # parameters, gradients, optimizer state (MiB)
        assert hsdp == pytest.approx(2 * fsdp, rel=0.1), rows


def test_dry_run_of_context_parallel_shows_it_and_the_memory_of_a_part_of_each_sequence(no_process_starts, capsys):
    """issue 56: context_parallel_size from the CLI; the stage lines name each pipeline rank's 4 ranks (dp x cp);
    activations per rank fall with cp (the blocks' of a part of each sequence), the model states stay."""
    rows = {}
    for cp in ("2", "1"):
        dp = "1" if cp == "2" else "2"
        out, code, _ = _dry_run(f"--trainer.strategy.init_args.context_parallel_size={cp}",
                                f"--trainer.strategy.init_args.data_parallel_size={dp}", "--dry_run", capsys=capsys)
        assert code is None, code
        rows[cp] = next([float(v) for v in line.split()[1:]] for line in out.splitlines()
                        if line.strip().startswith("0-3 "))
        if cp == "2":
            assert "dp=1 x pp=2 x cp=2 x tp=2 = 8 ranks" in out, out
            assert "context parallel: each sequence's blocks over 2 ranks, 4 load-balanced chunks" in out, out
            assert "stage 1 on ranks 4-7:" in out, out
    (params, grads, optimizer, activations, *_), whole = rows["2"], rows["1"]
    assert (params, grads) == (whole[0], whole[1]) and activations < whole[3], rows

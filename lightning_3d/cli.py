"""The ``lightning-3d`` console script (also ``python -m lightning_3d``): LightningCLI with omegaconf configs.

    lightning-3d fit --config example_configs/gpt_tiny_dp_cpu.yaml
    lightning-3d fit --config my.yaml --trainer.max_steps 20 --print_config
    lightning-3d fit --config example_configs/gpt_tiny_3d_cpu.yaml --dry_run   # layout, stages, memory; no run
    lightning-3d convert checkpoints/last.ckpt model.safetensors --strip-prefix model.
    lightning-3d plan --fit-config example_configs/gpt_1b_8gpu.yaml --gpu h100 --global-batch-size 32

``trainer.strategy`` may be ``3d`` or ``class_path: lightning_3d.ThreeDStrategy`` with ``init_args``; the
model and data are any LightningModule / LightningDataModule by ``class_path`` (the reference ones by short
name: ``GPTLightningModule``, ``SyntheticDataModule``). Configs may interpolate (``${model.init_args...}``);
interpolations are resolved as each file is read, so a command-line override of a model size does not
reach the data's copy of it: override both (``--model.init_args.config.block_size 64 --data.init_args.seq_len 64``).

Under ``torchrun`` or ``srun`` the launcher starts the processes and Lightning's torchelastic / SLURM
environment gives the ranks (see scripts/slurm/train.sbatch); the world size is then the launcher's.
"""

from __future__ import annotations

from importlib.util import find_spec

import os
import sys
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

import lightning_3d  # noqa: F401  (registers strategy="3d")
from lightning_3d.callbacks.progress import StepsProgressBar
from lightning_3d.models import GPTLightningModule, HFCausalLMModule, SyntheticDataModule  # noqa: F401  (short class names)
from lightning_3d.output import quiet_ranks
from lightning_3d.parallel.config import ParallelConfigError


# `plan` and `convert` are dispatched in main() before LightningCLI parses anything, so its subcommand list
# cannot show them: the top-level help names them here.
DESCRIPTION = (
    "Train with lightning-3d. Commands: fit, validate, test, predict (LightningCLI, below); "
    "plan: rank the layouts of a model on a cluster and write the best as a config (lightning-3d plan --help); "
    "convert: export a checkpoint to one file or to transformers (lightning-3d convert --help)."
)


class _CLI(LightningCLI):
    @override
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--dry_run", action="store_true",
                            help="Print the layout, the blocks per stage, each rank's estimated memory and the"
                            " warnings this run would give, then exit without starting a process.")

    @override
    def _run_subcommand(self, subcommand: str) -> None:
        # The trainer, model and data exist (and Trainer(...) has checked the layout against the processes it
        # would start): the dry run reads them instead of calling trainer.fit (lightning_3d.dry_run).
        if self.config[subcommand].get("dry_run"):
            from lightning_3d.dry_run import dry_run
            from lightning_3d.planner.model import PlannerError
            from lightning_3d.policies.base import PolicyError

            try:  # a layout error (ParallelConfigError) goes to main(), which reports it as a real run does
                print(dry_run(self.trainer, self.model, self.datamodule))
            except (PolicyError, PlannerError, FileNotFoundError) as err:  # a rank's traceback in a real run
                sys.exit(f"lightning-3d: error (dry run): {type(err).__name__}: {err}")
            return
        super()._run_subcommand(subcommand)

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        # Lightning's default Rich bar says "Epoch 0/-2" in a max_steps run; ours counts the steps. Only where
        # the config asks for a bar and names none (Lightning refuses two, or one with the bar turned off).
        config = (self.config_init[self.subcommand] if self.subcommand else self.config_init).get("trainer") or {}
        callbacks = config.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        wants_default_bar = config.get("enable_progress_bar") is not False and not any(
            isinstance(c, ProgressBar) for c in callbacks)
        if find_spec("rich") is not None and wants_default_bar and "callbacks" not in kwargs:
            kwargs["callbacks"] = [*callbacks, StepsProgressBar()]
        return super().instantiate_trainer(**kwargs)


def build_cli(args: list[str] | None = None, *, run: bool = True) -> LightningCLI:
    """The LightningCLI behind ``lightning-3d``. With ``run=False`` it only builds the trainer, model and data
    (``args`` then name no subcommand), e.g. to check a GPU config's objects on a machine without one::

        cli = build_cli(["--config", "example_configs/gpt_1b_8gpu.yaml", "--trainer.accelerator=cpu"], run=False)
        cli.trainer.strategy.parallel_config.tensor_parallel_size  # 2
    """
    return _CLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_kwargs={"parser_mode": "omegaconf", "prog": "lightning-3d", "description": DESCRIPTION},
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else args
    # `python -m lightning_3d` finds the user's modules in the current directory (`--model mypkg.MyModule`);
    # the console script's sys.path starts at its own bin/ folder instead, so the directory is added here.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    quiet_ranks()  # third-party warnings filtered, per-rank set-up lines from rank zero (lightning_3d.output)
    if argv[:1] == ["convert"]:  # not a Trainer subcommand: a checkpoint export (lightning_3d.checkpoint.convert)
        from lightning_3d.checkpoint.convert import main as convert

        return convert(argv[1:])
    if argv[:1] == ["plan"]:  # not a Trainer subcommand: the layout planner (lightning_3d.planner)
        from lightning_3d.planner.command import main as plan

        return plan(argv[1:])
    try:
        build_cli(args)
    except ParallelConfigError as err:
        # A layout or setting that cannot work (e.g. dp * pp * tp != the processes torchrun or srun started).
        # Every rank finds it before any collective; its message names the numbers and the fix, so each rank
        # says it in one line, as jsonargparse does for config errors, not in a traceback through Lightning.
        # rank_zero_only.rank: the global rank once the strategy has set it, else the launcher's guess.
        sys.exit(f"lightning-3d: error on rank {getattr(rank_zero_only, 'rank', 0)}: {err}")


if __name__ == "__main__":
    main()

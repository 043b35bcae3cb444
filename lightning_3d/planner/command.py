"""``lightning-3d plan``: which layouts fit a model on a cluster, ranked by estimated step time.

    lightning-3d plan --fit-config example_configs/gpt_1b_8gpu.yaml --gpu h100 --global-batch-size 32
    lightning-3d plan --layers 32 --hidden 4096 --heads 32 --vocab 32000 --seq-len 4096 --gated-mlp \\
        --gpu h100 --nodes 4 --global-batch-size 512 --yaml-out plan.yaml
    lightning-3d plan --hf ./Llama-2-7b-hf --gpu a100-80gb --nodes 2 --global-batch-size 256
    lightning-3d plan --config plan.yaml     # model: {...}, cluster: {...}, global_batch_size, precision

The model comes from one of: the sizes, a Hugging Face config (a config.json or its directory), the model
section of a ``lightning-3d fit`` config (the reference GPT), or ``--config``. Exit status 1 with a
message when no layout fits or the inputs are inconsistent.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields, replace
from pathlib import Path

import yaml

from lightning_3d.models import GPTConfig
from lightning_3d.planner.cluster import GPUS, Cluster
from lightning_3d.planner.memory import PRECISIONS
from lightning_3d.planner.model import ModelSpec, PlannerError
from lightning_3d.planner.search import plan
from lightning_3d.planner.time import COMPILE_ASSUMED

SIZE_FLAGS = {"layers": "num_layers", "hidden": "hidden_size", "heads": "num_heads", "kv_heads": "num_kv_heads",
              "ffn": "ffn_hidden_size", "vocab": "vocab_size", "seq_len": "seq_length", "experts": "num_experts",
              "experts_per_token": "experts_per_token", "expert_ffn": "expert_ffn_size",
              "shared_expert_ffn": "shared_expert_ffn_size"}
CLUSTER_FLAGS = {"gpus_per_node": "gpus_per_node", "nodes": "nodes", "memory_gib": "memory_gib",
                 "peak_tflops": "peak_tflops", "intra_bw": "intra_node_bandwidth_gbs",
                 "inter_bw": "inter_node_bandwidth_gbs", "gemm_efficiency": "gemm_efficiency"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-3d plan", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_argument_group("model (one source; sizes override it)")
    source.add_argument("--config", help="YAML with model (ModelSpec fields), cluster (Cluster fields or gpu),"
                        " global_batch_size, precision")
    source.add_argument("--fit-config", help="a `lightning-3d fit` YAML whose model is the reference GPT")
    source.add_argument("--hf", help="a Hugging Face config.json or a directory holding one")
    for flag in SIZE_FLAGS:
        source.add_argument(f"--{flag.replace('_', '-')}", dest=flag, type=int)
    source.add_argument("--gated-mlp", action="store_true", help="SwiGLU MLP (Llama-style)")
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--gpu", choices=sorted(GPUS), default=None, help="GPU kind (default h100)")
    for flag in CLUSTER_FLAGS:
        cluster.add_argument(f"--{flag.replace('_', '-')}", dest=flag, type=float if flag not in
                             ("gpus_per_node", "nodes") else int)
    run = parser.add_argument_group("run")
    run.add_argument("--global-batch-size", type=int, help="sequences per optimizer step")
    run.add_argument("--precision", choices=sorted(PRECISIONS), default=None, help="default bf16-mixed")
    run.add_argument("--top", type=int, default=10, help="rows of the table")
    run.add_argument("--yaml-out", help="write the best layout's `lightning-3d fit` config here")
    run.add_argument("--compile", action="store_true", help="the config compiles each block (compile=True);"
                     " its speed-up is assumed, not modelled")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        model, cluster, batch, precision = inputs(args)
        result = plan(model, cluster, global_batch_size=batch, precision=precision)
    except ValueError as err:  # PlannerError included
        sys.exit(f"lightning-3d plan: {err}")
    print(result.table(args.top))
    if args.compile:
        print(COMPILE_ASSUMED + ".")
    if args.yaml_out:
        Path(args.yaml_out).write_text(result.to_yaml(compile=args.compile))
        print(f"\nwrote the config of #1 to {args.yaml_out}: lightning-3d fit --config {args.yaml_out}")
    else:
        print("\n" + result.to_yaml(compile=args.compile))


def inputs(args: argparse.Namespace) -> tuple[ModelSpec, Cluster, int, str]:
    """Model, cluster, global batch size and precision from the flags (and ``--config``)."""
    file = yaml.safe_load(Path(args.config).read_text()) if args.config else {}
    sizes = {SIZE_FLAGS[flag]: getattr(args, flag) for flag in SIZE_FLAGS if getattr(args, flag) is not None}
    if args.gated_mlp:
        sizes["gated_mlp"] = True
    model = _model(args, file.get("model") or {}, sizes)
    cluster_values = dict(file.get("cluster") or {})
    gpu = args.gpu or cluster_values.pop("gpu", "h100")
    cluster_values.pop("gpu", None)
    cluster_values.update({CLUSTER_FLAGS[f]: getattr(args, f) for f in CLUSTER_FLAGS if getattr(args, f) is not None})
    known = {f.name for f in fields(Cluster)}
    if set(cluster_values) - known:
        raise PlannerError(f"unknown cluster fields {sorted(set(cluster_values) - known)}; known: {sorted(known)}.")
    cluster = Cluster.preset(gpu, **cluster_values)
    batch = args.global_batch_size or file.get("global_batch_size")
    if batch is None:
        raise PlannerError("give the global batch size (--global-batch-size, or global_batch_size in --config).")
    return model, cluster, batch, args.precision or file.get("precision", "bf16-mixed")


def _model(args, file_model: dict, sizes: dict) -> ModelSpec:
    if args.hf:
        return replace(ModelSpec.from_hf_config(args.hf), **sizes)
    if args.fit_config:
        fit = yaml.safe_load(Path(args.fit_config).read_text())
        config = ((fit.get("model") or {}).get("init_args") or {}).get("config")
        if not isinstance(config, dict):
            raise PlannerError(f"{args.fit_config} has no model.init_args.config (the reference GPT's sizes).")
        return replace(ModelSpec.from_gpt_config(GPTConfig(**config)), **sizes)
    values = {**file_model, **sizes}
    missing = [f for f in ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_length") if f not in values]
    if missing:
        flags = {v: k for k, v in SIZE_FLAGS.items()}
        raise PlannerError("the model needs " + ", ".join(f"--{flags[f].replace('_', '-')}" for f in missing)
                           + " (or --hf, --fit-config, --config).")
    try:
        return ModelSpec(**values)
    except TypeError as err:
        raise PlannerError(f"model: {err}; fields are {[f.name for f in fields(ModelSpec)]}.") from err

"""Module-replacement policies: how a model is split into blocks and parallel layers, as data.

Built-ins: ``"gpt"`` (the reference GPT), ``"llama"`` (Hugging Face Llama, Mistral, Qwen2) and ``"auto"``. Register your own with :func:`register_policy`.
"""

from lightning_3d.errors import LayoutError
from lightning_3d.policies.base import Plan, PlanOptions, Policy, PolicyError, find_submodule
from lightning_3d.policies.registry import register_policy, registered_policies, resolve_policy
from lightning_3d.policies import auto as _auto  # noqa: F401  (registers "auto")
from lightning_3d.policies import gpt as _gpt  # noqa: F401  (registers "gpt")
from lightning_3d.policies import hf_gpt2 as _hf_gpt2  # noqa: F401  (registers "gpt2"; imports no transformers)
from lightning_3d.policies import llama as _llama  # noqa: F401  (registers "llama"; transformers loaded on use)

__all__ = [
    "Plan",
    "PlanOptions",
    "Policy",
    "LayoutError",
    "PolicyError",
    "find_submodule",
    "register_policy",
    "registered_policies",
    "resolve_policy",
]

"""The engine side of the LoRA sync: vLLM serves the trainer's adapter as an adapter, apart from W.

Under ``--ds.lora.rank > 0`` the rollout engines start with vLLM's LoRA support (``enable_lora``, one adapter
slot, the smallest ``max_lora_rank`` vLLM allows at or above the run's rank: ``host.engine_lora_rank``). At each
weight sync the trainer sends the adapter's factors (``lora_A`` / ``lora_B`` under PEFT's checkpoint names) and
its PEFT config; :meth:`LoRAServing.load_lora_adapter` has every vLLM worker write them as a PEFT checkpoint in a
directory of its own and load it in place under one fixed adapter (:func:`install_adapter`, vLLM's own
``add_lora`` with ``load_inplace``); from then on every request the engine serves carries that adapter
(:class:`_ServingAdapter`), evaluation's included. Before the first sync no request carries one: the base model
is the policy then (B starts at 0). Every rollout also returns its sampled tokens' log-probs (as sampled), which the
trainer compares with its own: the metric ``lora/engine_gap`` (``lora_sync``).

Why not merge: ``W + scale * B @ A`` cast to bf16 rounds away every entry of the update under half a bf16 step of
W, and early in a LoRA run (B from 0, learning rates ~1e-5) that is most of it. The trainer's forward adds the
adapter's output to the base layer's instead, and vLLM's LoRA layers do the same (the base output, then the
adapter's added to it in the output's dtype), so the engine's log-probs change as the trainer's do.

A worker's adapter stays loaded until the next sync replaces it, or until vLLM's ``reload_weights`` unloads it (the
CPU runtime's weight sync reloads when weights other than the adapter arrive, after it): a request that finds it
unloaded loads it from its directory, which always holds the latest sync's files (one adapter per worker, removed
when the engine's process exits). vLLM's prefix-cache keys hold the adapter's name and path, not its weights: the
sync resets the cache after the install.
"""

import atexit
import copy
import json
import os
import shutil
import tempfile

from d3s_openrlhf.integration.seams import remote_like

ADAPTER_ID = 1
ADAPTER_NAME = "d3s-policy"


def install_adapter(worker, checkpoint, peft_config, directory):
    """In a vLLM worker (through ``collective_rpc``): ``checkpoint`` (the adapter's ``adapter_model.safetensors``,
    bytes) and ``peft_config`` (``adapter_config.json``'s fields) as the engine's adapter, replacing the last
    sync's. Returns the directory the worker loaded it from."""
    from vllm.lora.request import LoRARequest

    directory = os.path.join(directory, f"worker{getattr(worker, 'rank', 0)}")
    os.makedirs(directory, exist_ok=True)
    # written beside, then renamed: a request that loads from the directory never reads half a file
    for name, write in (
        ("adapter_model.safetensors", lambda path: _write_bytes(checkpoint, path)),
        ("adapter_config.json", lambda path: _write_json(peft_config, path)),
    ):
        write(os.path.join(directory, name + ".part"))
        os.replace(os.path.join(directory, name + ".part"), os.path.join(directory, name))
    if not worker.add_lora(LoRARequest(ADAPTER_NAME, ADAPTER_ID, directory, load_inplace=True)):
        raise RuntimeError(f"vLLM did not load the synced LoRA adapter from {directory}")
    return directory


def _write_json(value, path):
    with open(path, "w") as f:
        json.dump(value, f)


def _write_bytes(value, path):
    with open(path, "wb") as f:
        f.write(value)


class LoRAServing:
    """Mixin for OpenRLHF's ``RolloutRayActor`` (or the CPU runtime's): the engine starts with LoRA support for
    adapters up to :attr:`max_lora_rank`, and serves the synced adapter (module docstring).
    :func:`lora_serving_actor` builds the Ray actor class."""

    max_lora_rank: int  # vLLM's, one of its allowed values

    async def __init__(self, *args, **kwargs):
        lora = {"enable_lora": True, "max_loras": 1, "max_lora_rank": self.max_lora_rank}
        # the sampled tokens' log-probs as sampled (temperature applied), as upstream asks under IS correction
        kwargs.setdefault("logprobs_mode", "processed_logprobs")
        await super().__init__(*args, **kwargs, **lora)
        self._d3s_adapter = None  # the request every generation carries, once a sync installed the adapter
        self._d3s_adapter_dir = tempfile.mkdtemp(prefix="d3s-lora-")
        atexit.register(shutil.rmtree, self._d3s_adapter_dir, ignore_errors=True)
        self.llm = _ServingAdapter(self.llm, self)

    async def load_lora_adapter(self, tensors, peft_config):
        """Install the trainer's adapter (``tensors``: PEFT checkpoint names -> CPU tensors) in every worker."""
        from safetensors.torch import save
        from vllm.lora.request import LoRARequest

        # as the checkpoint's bytes: vLLM's RPC to its workers sends tensors inside a dict as lists
        checkpoint = save(tensors)
        directories = await self.llm.collective_rpc(
            install_adapter, args=(checkpoint, peft_config, self._d3s_adapter_dir)
        )
        self._d3s_adapter = LoRARequest(ADAPTER_NAME, ADAPTER_ID, directories[0])

    async def generate_responses(self, prompt, label, sampling_params, *args, **kwargs):
        """Upstream's, with the sampled tokens' log-probs always returned (``logprobs=0``: the sampled token's
        alone): the trainer compares them with its own (``lora/engine_gap``, ``lora_sync``)."""
        if sampling_params.logprobs is None:
            sampling_params = copy.copy(sampling_params)
            sampling_params.logprobs = 0
        return await super().generate_responses(prompt, label, sampling_params, *args, **kwargs)


class _ServingAdapter:
    """The engine as upstream's actor calls it, whose ``generate`` carries the synced adapter (every request or
    none: vLLM's CPU LoRA kernels give a request without an adapter the last slot's)."""

    def __init__(self, llm, actor):
        self._llm, self._actor = llm, actor

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def generate(self, *args, **kwargs):
        if self._actor._d3s_adapter is not None:
            kwargs["lora_request"] = self._actor._d3s_adapter
        return self._llm.generate(*args, **kwargs)


def lora_serving_actor(rollout_actor, max_lora_rank: int):
    """The Ray actor class of ``rollout_actor`` (a Ray actor class: upstream's ``RolloutRayActor`` or the CPU
    runtime's) serving LoRA adapters up to vLLM's ``max_lora_rank`` (:class:`LoRAServing`)."""
    base = rollout_actor.__ray_actor_class__
    cls = type(f"LoRA{base.__name__}", (LoRAServing, base), {"max_lora_rank": max_lora_rank, "__module__": __name__})
    return remote_like(rollout_actor, cls)

"""Weight sync between DeepSpeed rank 0 and vLLM CPU engines over a gloo process group.

OpenRLHF's own path does not work on CPU: its PyNccl communicator disables itself without an error (the
broadcast returns without sending and the engines keep stale weights), ``--vllm.sync_with_ray`` needs the
vLLM worker to be a Ray actor (vLLM spawns it as a plain process), and loading one parameter at a time
fails because vLLM's CPU kernels repack Linear weights when a model is loaded.

Both sides build the same stateless gloo group with vLLM's
``stateless_init_torch_distributed_process_group``. The engine buffers every received tensor and, on the
last one of a sync, reloads through vLLM's ``reload_weights``, which re-runs the post-load processing
(repacking, tied embeddings) exactly as at start-up. That reload must see every weight of each layer it
touches: a fused layer that gets only part of its weights (``q_proj`` of ``qkv_proj`` alone, when a LoRA run
adapts ``q_proj`` and ``v_proj`` only) is rebuilt with the rest uninitialised (NaN). So the engine keeps every
weight it has received, and the checkpoint's (read at its first sync) for the others, and reloads all of them,
the received ones first: one more copy of the weights in the engine process, which the CPU runtime's small
models afford.
"""

import torch


class GlooBroadcastGroup:
    """The model-update group OpenRLHF's trainer talks to (``broadcast(tensor, src=..., stream=...)``), on gloo."""

    def __init__(self, master_address, master_port, rank, world_size):
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        self.rank = rank
        self.world_size = world_size
        self._group = stateless_init_torch_distributed_process_group(
            master_address, master_port, rank, world_size, backend="gloo"
        )

    def broadcast(self, tensor, src=0, stream=None):
        """In-place broadcast from group rank ``src``; ``stream`` (a CUDA notion) is accepted and ignored."""
        if not tensor.is_contiguous():
            raise ValueError("gloo broadcasts contiguous tensors only")
        self._group.broadcast(tensor, src).wait()
        return tensor


def trainer_side_sync_group(master_address, master_port, rank, world_size, device=None):
    """Drop-in for ``openrlhf.utils.distributed_util.stateless_init_process_group`` (which returns PyNccl)."""
    return GlooBroadcastGroup(master_address, master_port, rank, world_size)


class GlooWeightSyncWorkerExtension:
    """vLLM ``worker_extension_cls``: the engine side of the sync, mixed into vLLM's CPU worker.

    Same RPC names and arguments as OpenRLHF's ``WorkerWrap``, reached through ``RolloutRayActor``'s
    ``collective_rpc`` calls. OpenRLHF's trainer sends one ``update_weight`` per parameter and sets
    ``empty_cache=True`` on the last one of a sync, which is when the buffered weights are loaded.
    """

    def init_process_group(
        self, master_address, master_port, rank_offset, world_size, group_name, backend="gloo", use_ray=False
    ):
        if use_ray:
            raise ValueError("the CPU runtime syncs weights over gloo; drop --vllm.sync_with_ray")
        rank = torch.distributed.get_rank() + rank_offset
        self._d3s_sync_group = GlooBroadcastGroup(master_address, master_port, rank, world_size)
        self._d3s_received = []
        self._d3s_synced = {}  # name -> the latest weight received
        self._d3s_checkpoint = None  # name -> the checkpoint's weight, read at the first sync

    def update_weight(self, name, dtype, shape, empty_cache=False):
        weight = torch.empty(shape, dtype=dtype)
        self._d3s_sync_group.broadcast(weight, src=0)
        self._d3s_received.append((name, weight))
        if empty_cache:
            self._d3s_load_received()

    def _d3s_load_received(self):
        received, self._d3s_received = self._d3s_received, []
        self._d3s_synced.update(received)
        if self._d3s_checkpoint is None:
            from vllm.model_executor.model_loader import get_model_loader

            loader = get_model_loader(self.vllm_config.load_config)
            checkpoint = loader.get_all_weights(self.vllm_config.model_config, self.model_runner.get_model())
            self._d3s_checkpoint = {name: weight.clone() for name, weight in checkpoint}
        for name in self._d3s_synced:
            self._d3s_checkpoint.pop(name, None)
        weights = [*self._d3s_synced.items(), *self._d3s_checkpoint.items()]
        self.reload_weights(weights_iterator=iter(weights))
        repack_shared_weights(self.model_runner.get_model())


def repack_shared_weights(model):
    """Re-run the post-load processing of every layer whose weight another layer shares (a tied LM head).

    vLLM's CPU kernels keep a packed copy of each Linear-like weight, built after loading. A reload refreshes
    the layers it loads; a tied LM head is not loaded (the checkpoint has only the embedding), so its packed
    copy would keep serving the old weights although the shared tensor itself is updated.
    """
    holders = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            holders.setdefault(id(weight), []).append(module)
    for modules in holders.values():
        if len(modules) < 2:
            continue
        for module in modules:
            quant_method = getattr(module, "quant_method", None)
            if quant_method is not None:
                quant_method.process_weights_after_loading(module)

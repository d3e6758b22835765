"""OpenRLHF's vLLM rollout actor with the gloo weight-sync extension (see :mod:`d3s_openrlhf.cpu.weight_sync`)."""

from openrlhf.trainer.ray.vllm_engine import RolloutRayActor

from d3s_openrlhf.cpu.precision import fp32_requested

WORKER_EXTENSION = "d3s_openrlhf.cpu.weight_sync.GlooWeightSyncWorkerExtension"


class CPURolloutRayActor(RolloutRayActor.__ray_actor_class__):
    """``create_vllm_engines`` hard-codes OpenRLHF's NCCL ``WorkerWrap`` and bfloat16; this actor swaps in the
    gloo extension, and float32 under ``D3S_OPENRLHF_CPU_FP32=1`` (the precision the trainers then use)."""

    async def __init__(self, *args, **kwargs):
        kwargs["worker_extension_cls"] = WORKER_EXTENSION
        if fp32_requested():
            kwargs["dtype"] = "float32"
        await super().__init__(*args, **kwargs)

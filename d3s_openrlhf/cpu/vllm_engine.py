"""OpenRLHF's vLLM rollout actor with the gloo weight-sync extension (see :mod:`d3s_openrlhf.cpu.weight_sync`)."""

from openrlhf.trainer.ray.vllm_engine import RolloutRayActor

WORKER_EXTENSION = "d3s_openrlhf.cpu.weight_sync.GlooWeightSyncWorkerExtension"


class CPURolloutRayActor(RolloutRayActor.__ray_actor_class__):
    """``create_vllm_engines`` hard-codes OpenRLHF's NCCL ``WorkerWrap``; this actor swaps in the gloo one."""

    async def __init__(self, *args, **kwargs):
        kwargs["worker_extension_cls"] = WORKER_EXTENSION
        await super().__init__(*args, **kwargs)

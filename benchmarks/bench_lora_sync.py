"""Time of one merged LoRA weight sync (the actor side of ``broadcast_to_vllm``) per training step, on CPU.

Real: upstream's ``ActorPPOTrainer.broadcast_to_vllm`` through our ``LoRASyncActorPPOTrainer``, a PEFT all-linear
LoRA model, the CPU runtime's gloo weight transport (``cpu/weight_sync.py``) to one engine in its own Ray actor,
a one-rank gloo group for the barrier, prefix caching on (one Ray call to the engine per reset). Stand-in: the
engine receives each weight into a buffer instead of loading it into vLLM (that load is the same whatever the
sync's shape), and answers ``reset_prefix_cache`` at once. ZeRO-2 (one rank): no gathering.

Models: the testbed's toy model (2 layers, 14 adapted layers) and a narrow Llama with 28 layers (196 adapted
layers, a 7B model's count under all-linear). Before/after: run the script with PYTHONPATH on each tree:

    git archive 448e71a | tar -x -C /tmp/before          # the per-layer sync
    flock /tmp/d3s-heavy.lock env PYTHONPATH=/tmp/before python benchmarks/bench_lora_sync.py --label before
    flock /tmp/d3s-heavy.lock env PYTHONPATH=$PWD python benchmarks/bench_lora_sync.py --label after

Each writes benchmarks/results/lora_sync_<label>.json (median and min over --syncs syncs after one warm-up).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import time
from pathlib import Path
from types import SimpleNamespace as NS

import ray
import torch
import torch.distributed as dist

from bench_selection import cpu_model  # benchmarks/ is sys.path[0] when this file runs


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@ray.remote(num_cpus=0)
class Engine:
    """The engine side of the transport: receives every broadcast weight, resets nothing."""

    def __init__(self, port):
        from d3s_openrlhf.cpu.weight_sync import GlooBroadcastGroup

        self.group = GlooBroadcastGroup("127.0.0.1", port, 1, 2)
        self.received = []

    def update_weight(self, name, dtype, shape, empty_cache=False):
        weight = torch.empty(shape, dtype=dtype)
        self.group.broadcast(weight, src=0)
        self.received.append(name)
        if empty_cache:
            self.received = []

    def reset_prefix_cache(self):
        return None


def models():
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    from d3s_openrlhf.testbed import toy

    toy_model = toy.build_model(toy.build_tokenizer())
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=28,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=True,
    )
    many = LlamaForCausalLM(config).to(torch.bfloat16)

    def lora():  # PEFT resolves all-linear into the config it is given: one config per model
        return peft.LoraConfig(task_type=peft.TaskType.CAUSAL_LM, r=8, lora_alpha=16, target_modules="all-linear")

    return {"toy (2 layers)": peft.get_peft_model(toy_model, lora()), "28 layers": peft.get_peft_model(many, lora())}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True)
    parser.add_argument("--syncs", type=int, default=10)
    args = parser.parse_args()

    from d3s_openrlhf.integration.lora_sync import LoRASyncActorPPOTrainer, lora_layers

    torch.cuda.synchronize = lambda *a, **k: None  # what the CPU runtime's stand-ins do
    torch.cuda.current_stream = lambda *a, **k: None
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    from d3s_openrlhf.cpu.weight_sync import GlooBroadcastGroup

    port = _free_port()
    engine = Engine.remote(port)
    group = GlooBroadcastGroup("127.0.0.1", port, 0, 2)
    ray.get(engine.__ray_ready__.remote())

    results = {}
    for name, model in models().items():
        trainer = object.__new__(LoRASyncActorPPOTrainer)
        trainer.actor = NS(model=NS(module=model), is_vlm=False)
        trainer.strategy = NS(
            args=NS(
                ds=NS(zero_stage=2, tensor_parallel_size=1), vllm=NS(enable_prefix_caching=True, sync_with_ray=False)
            )
        )
        trainer.vllm_engines, trainer._model_update_group, trainer.use_cuda_ipc = [engine], group, False
        times = []
        for _ in range(args.syncs + 1):
            start = time.perf_counter()
            trainer.broadcast_to_vllm()
            times.append(time.perf_counter() - start)
        results[name] = {
            "adapted_layers": len(lora_layers(model)),
            "median_s": statistics.median(times[1:]),
            "min_s": min(times[1:]),
        }
        print(name, results[name], flush=True)
    out = Path(__file__).with_name("results") / f"lora_sync_{args.label}.json"
    machine = f"{cpu_model()}, {os.cpu_count()} CPUs"
    document = dict(label=args.label, syncs=args.syncs, machine=machine, date=datetime.date.today().isoformat())
    out.write_text(json.dumps(dict(document, results=results), indent=1))
    ray.shutdown()


if __name__ == "__main__":
    main()

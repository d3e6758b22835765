"""The actor tests' model and batches (test_integration_actor.py, test_integration_experience_forward.py): a tiny
Llama written locally, OpenRLHF's ``Actor`` around it, experiences as the experience maker hands them over, and
upstream's entropy from its full logits. Imported by name (``import actor_batches``): tests/integration/conftest.py
puts this directory on the path, tests/ being no package."""

import torch
from openrlhf.models import Actor
from openrlhf.trainer.ppo_utils.experience import Experience

from d3s_openrlhf.integration.host import PG_MASK_KEY

VOCAB = 128
PROMPT = 3
WIDTH = 5


def write_tiny_llama(path):
    """A two-layer Llama over VOCAB word-level tokens, and its tokenizer, written to ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    vocab = {f"t{i}": i for i in range(VOCAB - 3)} | {"<unk>": VOCAB - 3, "<pad>": VOCAB - 2, "</s>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    special = dict(unk_token="<unk>", pad_token="<pad>", eos_token="</s>")
    PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(path)
    return str(path)


def point_cuda_at_cpu(monkeypatch):
    """OpenRLHF calls torch.cuda unconditionally; on this CPU build point those calls at the CPU."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    return monkeypatch


def as_one_deepspeed_rank(monkeypatch, **env):
    """The environment DeepSpeed reads of rank 0 of 1 (plus ``env``), and ``torch.nn.functional.linear`` put back
    afterwards: ZeRO-3 replaces it for the whole process ("This will persist unless manually reset")."""
    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", **env).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.nn.functional, "linear", torch.nn.functional.linear)
    return monkeypatch


def load_actor(model_dir, **kwargs):
    actor = Actor(model_dir, **{"attn_implementation": "eager", "param_dtype": "bf16", **kwargs})
    actor.model.float()  # fp32 so that reference comparisons can be tight
    return actor


def make_experience(actor, seed, rows=4, pg="random", left_pad=False):
    """A batch as the experience maker hands it over: right-padded responses, old/ref log-probs near the current
    policy's, per-token advantages, and (unless pg is None) the token mask as (rows, WIDTH + 2) bool rows. With
    ``left_pad``, prompts of 1 to PROMPT tokens left-padded to PROMPT (the first row's whole), as vLLM's rollouts
    of prompts of several lengths reach the trainer. Drawn on the CPU (the same batch on every device), it lives on
    the actor's device: upstream's forward there takes that device's path (on CUDA with flash-attn, its Triton
    cross-entropy, which refuses CPU tensors)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, WIDTH + 1, (rows,), generator=g)
    lengths[0] = WIDTH
    sequences = torch.randint(0, VOCAB - 3, (rows, PROMPT + WIDTH), generator=g)
    attention_mask = torch.zeros(rows, PROMPT + WIDTH, dtype=torch.long)
    prompts = torch.randint(1, PROMPT + 1, (rows,), generator=g) if left_pad else torch.full((rows,), PROMPT)
    prompts[0] = PROMPT
    for i, (n, p) in enumerate(zip(lengths.tolist(), prompts.tolist())):
        attention_mask[i, PROMPT - p : PROMPT + n] = 1
        sequences[i, : PROMPT - p] = VOCAB - 2
        sequences[i, PROMPT + n :] = VOCAB - 2
    action_mask = torch.arange(WIDTH)[None, :] < lengths[:, None]
    device = next(actor.parameters()).device
    sequences, attention_mask, action_mask = (t.to(device) for t in (sequences, attention_mask, action_mask))
    with torch.no_grad():
        current = actor(sequences, action_mask, attention_mask)
    noise = lambda scale: scale * torch.randn(rows, WIDTH, generator=g).to(device) * action_mask  # noqa: E731
    advantages = torch.randn(rows, 1, generator=g) + 0.2 * torch.randn(rows, WIDTH, generator=g)
    advantages = advantages.to(device) * action_mask
    info = {}
    if pg is not None:
        wide = torch.zeros(rows, WIDTH + 2, dtype=torch.bool)
        if pg == "all":
            wide[:, :WIDTH] = True
        elif pg == "none":
            pass  # no kept token at all (e.g. every advantage of the batch is 0)
        else:
            wide[:, :WIDTH] = (torch.rand(rows, WIDTH, generator=g) < 0.5) & action_mask.cpu()
            wide[1] = False  # a sequence with no kept token
            wide[0, 0] = True
        info[PG_MASK_KEY] = wide.to(device)
    return Experience(
        sequences=sequences,
        attention_mask=attention_mask,
        action_mask=action_mask,
        action_log_probs=current + noise(0.05),
        base_action_log_probs=current + noise(0.1),
        advantages=advantages,
        response_length=lengths.float().to(device),
        total_length=(prompts + lengths).float().to(device),
        info=info,
    )


def assert_forward_equals_upstreams(actor, e, forward, weight, values, grads):
    """``forward(actor, ...)`` on ``e`` against ``Actor.forward``: the log-probs within ``values`` (assert_close
    tolerances) and every parameter's gradient of ``(log_probs * weight).sum()`` within ``grads``. Returns
    upstream's log-probs."""
    results = []
    for run in (Actor.forward, forward):
        actor.zero_grad(set_to_none=True)
        log_probs = run(actor, e.sequences, e.action_mask, e.attention_mask)
        (log_probs * weight).sum().backward()
        results.append((log_probs.detach(), [p.grad.clone() for p in actor.parameters()]))
    (expected, expected_grads), (got, got_grads) = results
    torch.testing.assert_close(got, expected, **values)
    for grad, expected_grad in zip(got_grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, **grads)
    return expected


def assert_zero3_forwards_equal_upstreams(model_dir, device, values, grads):
    """ZeRO-3 at world size 1 on ``device`` (the process group formed by the caller): a DeepSpeed ZeRO-3 engine takes
    one AdamW step on upstream's ``Actor.forward`` loss (its gradients against the same model's without DeepSpeed)
    and the plain model gets the updated weights (Adam's first step is about lr x sign(gradient): two optimizers
    would part on the near-zero gradients); then, every parameter partitioned, the training forward on the engine
    against ``Actor.forward`` on the plain model (log-probs within ``values``; every parameter's full gradient,
    gathered from ZeRO-3's partitions, within ``grads``) and the chunked experience forward (log-probs and entropy
    within ``values``)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from d3s_openrlhf.integration.experience_forward import chunked_logits_log_probs
    from d3s_openrlhf.integration.training_forward import training_forward

    plain, sharded = (load_actor(model_dir, temperature=0.7) for _ in range(2))
    for actor in (plain, sharded):
        actor.model.to(device)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3}}
    engine, *_ = deepspeed.initialize(
        model=sharded.model, optimizer=torch.optim.AdamW(sharded.model.parameters(), lr=1e-3), config=config
    )
    sharded.model = engine

    def log_probs_and_grads(actor, forward, e):
        log_probs = forward(actor, e.sequences, e.action_mask, e.attention_mask)
        loss = (log_probs * e.advantages).sum()
        if actor is sharded:
            engine.backward(loss)
            return log_probs.detach(), [safe_get_full_grad(p) for p in engine.module.parameters()]
        plain.model.zero_grad(set_to_none=True)
        loss.backward()
        return log_probs.detach(), [p.grad for p in plain.model.parameters()]

    def assert_equal(got, expected, what):
        (log_probs, grads_got), (expected_log_probs, grads_expected) = got, expected
        torch.testing.assert_close(log_probs, expected_log_probs, **values, msg=lambda m: f"{what}: {m}")
        for name, grad, expected_grad in zip(names, grads_got, grads_expected):
            torch.testing.assert_close(grad, expected_grad, **grads, msg=lambda m: f"{what}, {name}: {m}")

    names = [name for name, _ in plain.model.named_parameters()]
    first, second = (make_experience(plain, seed=seed, rows=5, pg=None) for seed in (47, 48))
    expected = log_probs_and_grads(plain, Actor.forward, first)
    assert_equal(log_probs_and_grads(sharded, Actor.forward, first), expected, "upstream's forward, before the step")
    engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())), torch.no_grad():
        for mine, updated in zip(plain.model.parameters(), engine.module.parameters()):
            assert not torch.equal(mine, updated)  # every parameter has a gradient: each moved
            mine.copy_(updated)
    expected = log_probs_and_grads(plain, Actor.forward, second)
    assert_equal(log_probs_and_grads(sharded, training_forward, second), expected, "training forward, after the step")
    with torch.no_grad():
        log_probs, entropy = chunked_logits_log_probs(
            sharded, second.sequences, second.action_mask, second.attention_mask, with_entropy=True
        )
    torch.testing.assert_close(log_probs, expected[0], **values)
    torch.testing.assert_close(entropy, upstream_action_entropy(plain, second), **values)


def record_head_inputs(actor):
    """Shapes of the LM head's inputs, call by call."""
    shapes = []
    actor.model.get_output_embeddings().register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    return shapes


def naive_entropy(logits):
    return -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)


def upstream_action_entropy(actor, e):
    """The policy entropy at the action positions from upstream's full (B, S, V) temperature-scaled logits."""
    with torch.no_grad():  # re-padded by upstream when packed
        output = actor(e.sequences, None, e.attention_mask, return_output=True, allgather_logits=True)
    logits = output["logits"].reshape(*e.sequences.shape, -1)  # packed: upstream re-pads to (B, S, 1, V)
    return naive_entropy(logits[:, :-1][:, -e.action_mask.shape[1] :].float()) * e.action_mask


def wide_vocabulary_batch(tmp_path, rows):
    """A one-layer Llama with a 32,768-token vocabulary (its logits dwarf the rest) and a batch of ``rows`` full
    sequences of 64 tokens, 56 of them actions: ``(actor, sequences, attention_mask, action_mask)``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab, length, width = 32768, 64, 56
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    actor = load_actor(str(tmp_path))
    g = torch.Generator().manual_seed(0)
    sequences = torch.randint(0, vocab, (rows, length), generator=g)
    attention_mask = torch.ones(rows, length, dtype=torch.long)
    action_mask = torch.ones(rows, width, dtype=torch.bool)
    return actor, sequences, attention_mask, action_mask

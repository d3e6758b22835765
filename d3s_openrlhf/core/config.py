"""``D3SConfig``: every D3S / PODS option in one frozen dataclass, its presets, validation and ``--d3s.*`` flags.

Papers: D3S = "Learning More with Less: A Dynamic Dual-Level Down-Sampling Framework for Efficient Policy
Optimization" (arXiv 2509.22115); PODS = "Not All Rollouts are Useful: Down-Sampling Rollouts in LLM
Reinforcement Learning" (arXiv 2504.13818).

Resolution order (``from_flags``): dataclass defaults, then the named preset's values, then every explicitly
given field. The defaults are "off" (plain GRPO). The constructor itself takes its fields literally: ``preset``
only records the preset a configuration was resolved from, it does not apply it.

Our choices where the papers give no number: the fixed-size variants (d1s, d1s-cross, d2s) keep N = 20 rollouts
per prompt and d2s keeps K = 12.5% of tokens, the time averages of the D3S linear schedule (N 8 -> 32,
K 5% -> 20%), so the variants spend about the same sample and token budget as D3S over a run.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Dict, Mapping, Optional

from d3s_openrlhf.core.batching import OPTIMIZER_STEP_MODES
from d3s_openrlhf.core.checks import InvalidOptions, Problem, is_int
from d3s_openrlhf.core.prompt_skip import PROMPT_SKIP_MODES, PromptSkipPolicy
from d3s_openrlhf.core.schedule import SCHEDULE_KINDS, DownSamplingSchedule
from d3s_openrlhf.core.selection import SAMPLE_SCOPES, SELECTION_RULES
from d3s_openrlhf.core.token_mask import TOKEN_SCOPES

SAMPLE_RULES = (*SELECTION_RULES, "none")
ADVANTAGE_MODES = ("group", "subset")

FLAG_PREFIX = "d3s."

# PromptSkipPolicy's parameters -> the options that set them
_SKIP_FIELDS = {"base": "skip_base", "floor": "skip_floor", "target": "skip_target", "rate": "skip_rate"}

_FIXED_N = 20  # mean of the D3S linear schedule 8 -> 32 (our choice, see the module docstring)
_FIXED_K = 0.125  # mean of the D3S linear schedule 0.05 -> 0.20

# Presets are built from shared parts, so that each one differs from its neighbour only where the paper's does.
_MAX_VAR = dict(sample_rule="max_var", advantage_mode="group")
_NO_TOKENS = dict(k_init=1.0, k_final=1.0)
_FIXED_SAMPLES = dict(n_init=_FIXED_N, n_final=_FIXED_N, schedule="constant")
_D1S = dict(sample_scope="intra", **_MAX_VAR, **_FIXED_SAMPLES, **_NO_TOKENS)
_D3S = dict(
    sample_scope="cross",
    **_MAX_VAR,
    n_init=8,
    n_final=32,
    k_init=0.05,
    k_final=0.20,
    schedule="linear",
    token_scope="batch",
)

PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        name: MappingProxyType(fields)
        for name, fields in {
            "grpo": dict(sample_rule="none", **_NO_TOKENS),
            "pods": dict(
                sample_scope="intra",
                sample_rule="max_var",
                advantage_mode="subset",
                n_init=16,
                n_final=16,
                schedule="constant",
                **_NO_TOKENS,
            ),
            "d1s": _D1S,
            "d1s-cross": {**_D1S, "sample_scope": "cross"},
            "d2s": {**_D1S, "sample_scope": "cross", "k_init": _FIXED_K, "k_final": _FIXED_K, "token_scope": "batch"},
            "d3s": _D3S,
            "d3s-i": {**_D3S, "sample_scope": "intra"},
        }.items()
    }
)

PRESET_SUMMARIES: Mapping[str, str] = MappingProxyType(
    {
        "grpo": "no down-sampling (plain GRPO / the host's estimator)",
        "pods": "PODS: intra-group max-variance on rewards, N = m = 16 kept of n, advantages over the subset",
        "d1s": f"D1S: intra-group max-variance, fixed N = {_FIXED_N}, full-group advantages, no token selection",
        "d1s-cross": f"D1S-Cross: cross-group max-variance, fixed N = {_FIXED_N}, no token selection",
        "d2s": f"D2S: cross-group samples (N = {_FIXED_N}) + tokens (K = {_FIXED_K}), no schedule",
        "d3s": "D3S: cross-group samples + tokens, linear schedule N 8 -> 32, K 0.05 -> 0.20",
        "d3s-i": "D3S-I: D3S with intra-group sample selection",
    }
)


def _option(default, help: str, type_, choices=None):
    return field(default=default, metadata={"help": help, "type": type_, "choices": choices})


@dataclass(frozen=True)
class D3SConfig:
    """All D3S / PODS options (see the module docstring for presets and resolution)."""

    preset: Optional[str] = _option(
        None,
        "named configuration applied before the explicit --d3s.* flags: "
        + "; ".join(f"{name} = {summary}" for name, summary in PRESET_SUMMARIES.items()),
        str,
        tuple(PRESETS),
    )
    sample_scope: str = _option(
        "cross",
        "where sample-level selection picks rollouts: intra = N of each prompt's G rollouts (D3S-I, PODS); "
        "cross = N*B from all B*G rollouts pooled, so a prompt may keep many, few or none (D3S)",
        str,
        SAMPLE_SCOPES,
    )
    sample_rule: str = _option(
        "none",
        "sample-level rule: max_var = the subset with maximal advantage variance Var(A') (D3S sample level; "
        "PODS max-variance down-sampling); max_reward and random = PODS's ablation rules; none = keep all",
        str,
        SAMPLE_RULES,
    )
    advantage_mode: str = _option(
        "group",
        "group = advantages A_i from the full group of G, not renormalised after selection (D3S); "
        "subset = recomputed over the kept rollouts of each group (PODS)",
        str,
        ADVANTAGE_MODES,
    )
    n_init: int = _option(
        8,
        "rollouts kept per prompt at the start of training, D3S N_init (PODS m for a constant schedule); "
        "the group size G = --rollout.n_samples_per_prompt (PODS n) must be at least max(N)",
        int,
    )
    n_final: int = _option(
        32,
        "rollouts kept per prompt at the end of the schedule, D3S N_final (any order relative to N_init is "
        "accepted; the paper increases N)",
        int,
    )
    k_init: float = _option(
        1.0,
        "fraction of response tokens kept (top |A_{i,t}|*H_{i,t}) at the start, D3S K_init in (0, 1]; "
        "1.0 with K_final 1.0 = no token selection",
        float,
    )
    k_final: float = _option(
        1.0,
        "fraction of response tokens kept at the end of the schedule, D3S K_final in (0, 1]",
        float,
    )
    schedule: str = _option(
        "linear",
        "how [N, K] move from init to final with training progress p: linear = (1-p)*init + p*final "
        "(D3S dynamic down-sampling schedule); cosine = the same with p' = (1-cos(pi*p))/2; "
        "constant = the init values throughout (N_final, K_final unused)",
        str,
        SCHEDULE_KINDS,
    )
    schedule_steps: int = _option(
        0,
        "S, the steps over which p goes from 0 to 1: p = min(step / (S - 1), 1) at the 0-based step, so the first "
        "step trains the init values and step S - 1 (logged as step S) the final ones (S = 1: the final ones); "
        "0 = the run's number of rollout steps. With prompt skipping (--d3s.prompt_skip) it is required, and with "
        "it or with --algo.dynamic_filtering_enable the run trains exactly this many steps, cycling over the "
        "prompts as often as it takes. Refused with D3S off, where nothing reads it (upstream's run trains its own "
        "passes, dynamic filtering included): turn D3S on, e.g. with --d3s.chunked_logits",
        int,
    )
    optimizer_steps: str = _option(
        "fixed_batch",
        "how the kept rollouts of a rollout step become optimizer steps: fixed_batch = one per --train.batch_size "
        "kept rollouts (OpenRLHF's rule), so a step that keeps fewer takes fewer, e.g. D3S at N 4 of G 16 a "
        "quarter of GRPO's; fixed_updates = as many as training all B*G rollouts would (B*G / --train.batch_size "
        "per epoch), each on kept / that many rollouts, so every step takes GRPO's number of updates. The D3S paper "
        "does not say which it used",
        str,
        OPTIMIZER_STEP_MODES,
    )
    token_scope: str = _option(
        "batch",
        "where the token budget K applies: batch = over all kept tokens of the rollout batch (the D3S "
        "formula); sequence = within each response",
        str,
        TOKEN_SCOPES,
    )
    seed: int = _option(
        42,
        "seed of the random tie-breaking and of the random rule, combined with the training step so every "
        "step's choice is reproducible, also after a resume; and of the skip decisions of the generation level, "
        "keyed by batch and prompt",
        int,
    )
    prompt_skip: str = _option(
        "off",
        "prompt-level down-sampling before generation: history = a prompt whose latest group had equal rewards is "
        "skipped with its own probability 1 - max(base^c, floor), c its streak of such groups (GRESO's rule, arXiv "
        "2506.02177), and its slot refilled from the dataloader; needs rewards at generation time "
        "(--reward.remote_url or an agent) and --d3s.schedule_steps (docs/generation.md)",
        str,
        PROMPT_SKIP_MODES,
    )
    skip_base: float = _option(
        0.5,
        "the base of the per-prompt skip probability 1 - max(base^c, floor) at the start, in [0.05, 0.95]; it adapts "
        "after every batch that drew a skip candidate",
        float,
    )
    skip_floor: float = _option(
        0.01,
        "the exploration floor, in [0.01, 1): a candidate is still generated with probability at least this at every "
        "visit, so a prompt that becomes informative again comes back",
        float,
    )
    skip_target: float = _option(
        0.25,
        "the share of zero-variance groups among the prompts generated that the base steers towards, in [0, 1): above "
        "it the base falls by --d3s.skip_rate x (share - target), so more is skipped",
        float,
    )
    skip_rate: float = _option(0.01, "the base's adaptation step per batch, > 0", float)
    stall_passes: int = _option(
        4,
        "how many passes over the prompts may go by without a single group joining a batch before the run stops as "
        "one that cannot fill (every group outside --algo.dynamic_filtering_range, at fixed steps): a run that fills, "
        "however slowly, goes on. An int >= 1; takes effect with --algo.dynamic_filtering_enable and "
        "--d3s.schedule_steps",
        int,
    )
    full_logits: bool = _option(
        False,
        "compute upstream's full-vocabulary logits in every forward. By default, at steps with K < 1 the actor's "
        "and the reference's forwards compute the log-probs (and entropy) from the final hidden states, one block of "
        "logits at a time (no (B, S, V) logits): the experience-making forwards at the action tokens, the training "
        "forward at the kept tokens when the loss reads only those (PPO-clip) and at every action token otherwise "
        "(KL loss, GSPO, entropy bonus)",
        bool,
    )
    chunked_logits: bool = _option(
        False,
        "compute the log-probs (and entropy) with chunked logits (never the full logits), as at K < 1, at every "
        "step: also at K = 1 and with sample selection alone (PODS)",
        bool,
    )
    dry_run: bool = _option(
        False,
        "validate the configuration against the host flags, print the resolved D3S settings and the kept "
        "counts along the schedule, and exit without starting Ray",
        bool,
    )

    def __post_init__(self):
        for name in ("k_init", "k_final"):
            value = getattr(self, name)
            if is_int(value):
                object.__setattr__(self, name, float(value))
        self.validate()

    def validate(self) -> None:
        """Raise InvalidOptions (a ValueError) with every invalid option as a Problem: ``--d3s.<field>``, its value
        and the requirement it fails."""
        problems = []

        def bad(name: str, requirement: str) -> None:
            problems.append(Problem(f"--{FLAG_PREFIX}{name}", getattr(self, name), requirement))

        if self.preset is not None and (not isinstance(self.preset, str) or self.preset not in PRESETS):
            bad("preset", f"unknown preset; choose one of {', '.join(PRESETS)}")
        for f in fields(self):
            choices = f.metadata["choices"]
            if f.name != "preset" and choices is not None and getattr(self, f.name) not in choices:
                bad(f.name, f"must be one of {', '.join(choices)}")
        for name in ("n_init", "n_final"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                bad(name, "must be an int >= 1 (rollouts kept per prompt)")
        for name in ("k_init", "k_final"):
            value = getattr(self, name)
            if not isinstance(value, float) or not (0.0 < value <= 1.0):  # ints were made floats, bools not
                bad(name, "must be a number in (0, 1] (fraction of tokens kept; 1 = all)")
        for name in ("schedule_steps", "seed"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                bad(name, "must be an int >= 0")
        for name in ("full_logits", "chunked_logits", "dry_run"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be a bool")
        # the skip options' ranges are the policy's own
        skip_values = {parameter: getattr(self, name) for parameter, name in _SKIP_FIELDS.items()}
        for problem in PromptSkipPolicy.problems(**skip_values):
            bad(_SKIP_FIELDS[problem.parameter], problem.requirement)
        if not is_int(self.stall_passes) or self.stall_passes < 1:
            bad("stall_passes", "must be an int >= 1 (passes over the prompts without a group joining a batch)")
        if self.skip_enabled and is_int(self.schedule_steps) and self.schedule_steps <= 0:
            bad(
                "schedule_steps",
                f"must be > 0 with --d3s.prompt_skip {self.prompt_skip}: prompts that are skipped make a pass over "
                "the data shorter by an unknown number of steps, so the run trains a fixed number S of steps "
                "instead, cycling over the prompts (set --d3s.schedule_steps S; it is also the (N, K) schedule's and "
                "the LR schedule's horizon)",
            )
        # whether D3S is on reads the schedule's range, known once the other options are valid
        if not problems and self.stall_passes != D3SConfig.stall_passes and not self.enabled:
            bad("stall_passes", "does nothing with D3S off (nothing of D3S runs); drop it")
        if not problems and self.schedule_steps > 0 and not self.enabled:
            bad(
                "schedule_steps",
                "does nothing with D3S off (no sample or token selection, prompt skipping or --d3s.chunked_logits): "
                "the run is OpenRLHF's own train_ppo_ray, which trains its own passes over the data, with "
                "--algo.dynamic_filtering_enable too; to train exactly S steps turn D3S on (e.g. "
                "--d3s.chunked_logits, which only computes the log-probs with less memory), or drop it",
            )
        if not problems and self.fixed_updates and not self.samples_enabled:
            bad(
                "optimizer_steps",
                "changes the optimizer batch of steps that keep fewer than all B*G rollouts, but without sample "
                f"selection (--d3s.sample_rule {self.sample_rule}) every step keeps them all and already takes "
                "upstream's updates; drop it, or choose a sample rule",
            )
        if self.full_logits is True and self.chunked_logits is True:
            bad("chunked_logits", "contradicts --d3s.full_logits=True (upstream's full logits everywhere); set one")
        if self.advantage_mode == "subset" and self.sample_rule == "none":
            bad(
                "advantage_mode",
                "recomputes advantages over the kept rollouts, which needs sample selection, but "
                f"--d3s.sample_rule={self.sample_rule!r}; choose a rule or --d3s.advantage_mode group",
            )
        if problems:
            raise InvalidOptions("invalid D3S options", problems)

    # -- derived ---------------------------------------------------------------------------------------------

    @property
    def samples_enabled(self) -> bool:
        """Whether sample-level selection runs (sample_rule != none)."""
        return self.sample_rule != "none"

    @property
    def fixed_updates(self) -> bool:
        """Whether every rollout step takes the optimizer steps of a full batch (--d3s.optimizer_steps
        fixed_updates), not one per --train.batch_size kept rollouts."""
        return self.optimizer_steps == "fixed_updates"

    @property
    def tokens_enabled(self) -> bool:
        """Whether token selection runs at some point of the schedule (K < 1 somewhere)."""
        return self._range.min_k < 1.0

    @property
    def skip_enabled(self) -> bool:
        """Whether prompts may be skipped before generation (--d3s.prompt_skip history): the run then cycles its
        prompts for exactly --d3s.schedule_steps training steps."""
        return self.prompt_skip != "off"

    @property
    def enabled(self) -> bool:
        """Whether D3S changes anything (skipping prompts, sample or token selection, the forwards at K = 1)."""
        return self.samples_enabled or self.tokens_enabled or self.skip_enabled or self.chunked_logits

    def skip_policy(self) -> PromptSkipPolicy:
        """A fresh prompt-skip policy with these options."""
        return PromptSkipPolicy(**{parameter: getattr(self, name) for parameter, name in _SKIP_FIELDS.items()})

    @property
    def max_n(self) -> int:
        """The largest N (rollouts kept per prompt) along the schedule; G must be at least this."""
        return self._range.max_n

    @property
    def n_values(self) -> range:
        """Every N the schedule can return, whatever the run's length."""
        return self._range.n_values

    @property
    def schedule_moves(self) -> bool:
        """Whether what the schedule drives changes during the run: K, and N with sample selection on."""
        driven = self._range if self.samples_enabled else dataclasses.replace(self._range, n_final=self.n_init)
        return driven.moves

    @property
    def _range(self) -> DownSamplingSchedule:
        # the values a schedule can take do not depend on its horizon: any horizon answers for all of them
        return self.schedule_for(1)

    def schedule_for(self, total_steps: int) -> DownSamplingSchedule:
        """The (N, K) schedule of a run of ``total_steps`` rollout steps (``schedule_steps`` wins if > 0)."""
        steps = self.schedule_steps if self.schedule_steps > 0 else total_steps
        return DownSamplingSchedule(self.n_init, self.n_final, self.k_init, self.k_final, steps, kind=self.schedule)

    def to_dict(self) -> Dict[str, Any]:
        """Plain {field: value} dict (for logging and printing)."""
        return dataclasses.asdict(self)

    # -- command line ----------------------------------------------------------------------------------------

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
        """Add one ``--d3s.<field>`` flag per field (dest ``d3s.<field>``, default None) in a new group."""
        group = parser.add_argument_group(
            "D3S / PODS rollout and token down-sampling (d3s-openrlhf)",
            "Unset flags take the preset's value, else the default shown.",
        )
        for f in fields(cls):
            help_text = f"{f.metadata['help']} (default: {f.default})".replace("%", "%%")
            flag, dest = f"--{FLAG_PREFIX}{f.name}", f"{FLAG_PREFIX}{f.name}"
            if f.metadata["type"] is bool:
                group.add_argument(flag, dest=dest, action="store_true", default=None, help=help_text)
            else:
                group.add_argument(
                    flag,
                    dest=dest,
                    type=f.metadata["type"],
                    choices=f.metadata["choices"],
                    metavar=None if f.metadata["choices"] else f.name.upper(),
                    default=None,
                    help=help_text,
                )
        return group

    @classmethod
    def from_flags(cls, values: Mapping[str, Any]) -> "D3SConfig":
        """Resolve given options (keys ``d3s.<field>`` or ``<field>``; None = not given) into a validated config.

        The preset named by ``preset`` (if any) is applied first, explicit values override it, and the preset
        name is kept on the result.
        """
        names = {f.name for f in fields(cls)}
        given: Dict[str, Any] = {}
        unknown = []
        for key, value in values.items():
            name = key[len(FLAG_PREFIX) :] if key.startswith(FLAG_PREFIX) else key
            if name not in names:
                unknown.append(key)
            elif value is not None:
                given[name] = value
        if unknown:
            raise ValueError(
                f"unknown D3S options: {', '.join(map(repr, unknown))}; known: "
                + ", ".join(f"--{FLAG_PREFIX}{name}" for name in sorted(names))
            )
        preset = given.get("preset")
        resolved: Dict[str, Any] = dict(PRESETS[preset]) if isinstance(preset, str) and preset in PRESETS else {}
        resolved.update(given)
        return cls(**resolved)

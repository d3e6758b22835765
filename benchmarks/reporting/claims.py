"""The papers' claims against the analysed study (:func:`study.study_analysis`): each with its verdict (agrees,
disagrees, not resolved at this scale) and the numbers it rests on."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .stats import mean_std, p_text, welch_t_test
from .study import SMOOTH

PAPER_SPEEDUP = {"D3S": 2.04, "PODS": 1.7}  # D3S: 2.04x faster than GRPO; PODS: >= 1.7x sooner to GRPO's peak
ALPHA = 0.05  # a difference is called resolved when the Welch test's p is below this
AGREES, DISAGREES, UNRESOLVED = "agrees", "disagrees", "not resolved at this scale"


@dataclass(frozen=True)
class Claim:
    """A paper's claim and what the study shows; ``line``: ``- {label}: **{verdict}**{detail}``."""

    label: str  # who claims what, e.g. 'D3S, "2.04x faster than GRPO"'
    verdict: str  # AGREES, DISAGREES or UNRESOLVED
    detail: str  # the numbers, right after the verdict (". GRPO's final ..." or " (qualifier). ...")

    @property
    def line(self):
        return f"- {self.label}: **{self.verdict}**{self.detail}"


def _speedup(base, method):
    """GRPO's wall time / the method's to the same accuracy, or None if either never reached it."""
    if base["wall"] is None or method["wall"] is None or method["wall"] == 0:
        return None
    return base["wall"] / method["wall"]


def _reach_text(r):
    """When a :func:`study.reach` result got there, as the claims print it."""
    return "never" if r["step"] is None else f"at step {r['step']} ({r['wall']:.0f} s of steps)"


def _reward_speedup(grpo, method, which):
    """GRPO's wall time / the method's to GRPO's ``which`` (final or peak) smoothed training reward, or None."""
    return _speedup(grpo[f"reward_reach_{which}"], method[f"reward_reach_{which}"])


def _reward_clock(grpo, method, which, name):
    """The same race on the per-step training reward (GRPO's ``which`` = final or peak smoothed reward)."""
    key = f"reward_reach_{which}"
    base, other = grpo[key], method[key]
    if other["step"] is None:
        return f"On the training reward ({SMOOTH}-step mean, per step) {name} never reaches GRPO's {which} value."
    text = (
        f"On the training reward ({SMOOTH}-step mean, per step) GRPO reaches its {which} value at step {base['step']} "
        f"({base['wall']:.0f} s), {name} at step {other['step']} ({other['wall']:.0f} s)"
    )
    speedup = _reward_speedup(grpo, method, which)
    return text + ("." if speedup is None else f": a speed-up of {speedup:.2f}x in wall time (GRPO's over {name}'s).")


def _speed_verdict(heldout, reward, claimed, drift):
    """``(verdict, qualifier)`` on "at least ``claimed``x faster" from the measured wall-time speedups on the
    held-out clock and on the training-reward clock (None where the method never got there); ``drift``: the
    relative spread of the same method's step time over seeds, which a wall-time ratio cannot resolve. Only the
    held-out clock can agree (the training reward is in-sample); either clock within the drift of the claim leaves
    it unresolved."""
    if heldout is not None and heldout >= claimed:
        return AGREES, ""
    if heldout is not None and heldout * (1 + drift) >= claimed:
        return UNRESOLVED, " (within the machine's drift of the claimed factor)"
    if reward is not None and reward * (1 + drift) >= claimed:
        within = "" if reward >= claimed else ", within the machine's drift"
        return UNRESOLVED, f" (only the in-sample training-reward clock shows the factor{within})"
    return DISAGREES, " (held-out accuracy: never reached within the run)" if heldout is None else ""


def step_time_drift(parts):
    """The largest relative spread (max - min) / mean over seeds of one method's mean step time."""
    spreads = [0.0]
    for analysed in parts.values():
        for m in analysed["info"].values():
            times = [r["step_time"]["timing/step_total"].mean() for r in m["runs"]]
            spreads.append((max(times) - min(times)) / np.mean(times))
    return float(max(spreads))


def _order_verdict(tests):
    """Verdict on a claimed ordering a > b > c from the Welch tests of its adjacent pairs (t > 0: as claimed)."""
    if any(t < 0 and p < ALPHA for t, p in tests):
        return DISAGREES
    if all(t > 0 and p < ALPHA for t, p in tests):
        return AGREES
    return UNRESOLVED


def drift_line(parts):
    """What the machine's drift of step times means for the wall-time claims."""
    return (
        f"- Machine drift: one method's mean step time varied by up to {100 * step_time_drift(parts):.0f}% between "
        "seeds (the same flags, hence the same work): wall-time ratios closer than that to a claimed factor are not "
        "resolved; steps and trained tokens are unaffected."
    )


def claims(parts, eval_every):
    """The papers' claims (:class:`Claim`), each with what the study shows (agrees / disagrees / not resolved)."""
    drift = step_time_drift(parts)
    found = []
    pods, family = parts.get("pods"), parts.get("d3s")
    resolution = f"(evaluations every {eval_every} steps bound the resolution of every time-to-accuracy)"
    if pods and {"GRPO", "PODS"} <= set(pods["info"]):
        grpo, method = pods["info"]["GRPO"], pods["info"]["PODS"]
        speedup = _speedup(grpo["reach_peak"], method["reach_peak"])
        reward = _reward_speedup(grpo, method, "peak")
        verdict, qualifier = _speed_verdict(speedup, reward, PAPER_SPEEDUP["PODS"], drift)
        label = f'PODS, "reaches GRPO\'s peak at least {PAPER_SPEEDUP["PODS"]}x sooner"'
        detail = (
            f"{qualifier}. GRPO (n = m = {grpo['group']}) peaks at "
            f"{pods['peak']:.3f} held-out greedy, reached first {_reach_text(grpo['reach_peak'])}; PODS (n = "
            f"{method['group']}, m = {grpo['group']}) reaches it {_reach_text(method['reach_peak'])}"
            + ("" if speedup is None else f": a speed-up of {speedup:.2f}x in wall time (GRPO's over PODS's)")
            + f" {resolution}. {_reward_clock(grpo, method, 'peak', 'PODS')} Final greedy "
            f"{mean_std(method['final_greedy'])} against GRPO's {mean_std(grpo['final_greedy'])} "
            f"(p = {p_text(method['test_vs_grpo'])})."
        )
        found.append(Claim(label, verdict, detail))
    rules = ["PODS", "PODS-random", "PODS-max-reward"]
    if pods and set(rules) <= set(pods["info"]):
        ms = [pods["info"][r] for r in rules]
        tests = [welch_t_test(a["mean_greedy"], b["mean_greedy"]) for a, b in zip(ms, ms[1:])]
        label = 'PODS\'s rule ablation, "max-variance > random > max-reward" (82.6 / 81.6 / 67.3 on GSM8K)'
        detail = (
            ". Held-out greedy accuracy averaged over the run's evaluations (how fast and how "
            f"far it learns): {' / '.join(mean_std(m['mean_greedy']) for m in ms)}; final "
            f"{' / '.join(mean_std(m['final_greedy']) for m in ms)}. Welch p of max-variance vs random "
            f"{p_text(tests[0])}, random vs max-reward {p_text(tests[1])}."
        )
        found.append(Claim(label, _order_verdict(tests), detail))
    if not family or "GRPO" not in family["info"]:
        return found
    info = family["info"]
    grpo = info["GRPO"]
    if "D3S" in info:
        d3s = info["D3S"]
        speedup = _speedup(grpo["reach_final"], d3s["reach_final"])
        steps = None
        if d3s["reach_final"]["step"] and grpo["reach_final"]["step"]:
            steps = grpo["reach_final"]["step"] / d3s["reach_final"]["step"]
        reward = _reward_speedup(grpo, d3s, "final")
        verdict, qualifier = _speed_verdict(speedup, reward, PAPER_SPEEDUP["D3S"], drift)
        detail = (
            f"{qualifier}. GRPO's final held-out greedy {family['target']:.3f} is first reached by GRPO "
            f"{_reach_text(grpo['reach_final'])}, by D3S {_reach_text(d3s['reach_final'])}"
            + (
                ""
                if speedup is None
                else f": a speed-up of {speedup:.2f}x in wall time, {steps:.2f}x in steps (GRPO's over D3S's)"
            )
            + f" {resolution}. {_reward_clock(grpo, d3s, 'final', 'D3S')} Final greedy "
            f"{mean_std(d3s['final_greedy'])} against GRPO's {mean_std(grpo['final_greedy'])} "
            f"(p = {p_text(d3s['test_vs_grpo'])})."
        )
        found.append(Claim(f'D3S, "{PAPER_SPEEDUP["D3S"]}x faster than GRPO"', verdict, detail))
        share = d3s["tokens_total"] / grpo["tokens_total"]
        detail = (
            f". D3S trained on {100 * share:.1f}% of GRPO's policy-gradient tokens over the run "
            f"({d3s['tokens_total'] / 1e3:.1f}k against {grpo['tokens_total'] / 1e3:.1f}k, seed means); this follows "
            "from the schedule's N and K and the zero-variance groups, not from learning."
        )
        found.append(Claim('D3S, "under 20% of the tokens"', AGREES if share < 0.2 else DISAGREES, detail))
        test = welch_t_test(d3s["grad_mean"], grpo["grad_mean"])
        baseline = np.mean(grpo["grad_mean"])  # 0 when every GRPO group had equal rewards
        ratio = f"{np.mean(d3s['grad_mean']) / baseline:.2f}x" if baseline > 0 else "no ratio: GRPO's norm is 0"
        detail = (
            f". Mean actor gradient norm over the run {mean_std(d3s['grad_mean'], '{:.2f}')} against GRPO's "
            f"{mean_std(grpo['grad_mean'], '{:.2f}')} "
            f"({ratio}, Welch p = {p_text(test)}; OpenRLHF logs the norm of a step's last optimizer step)."
        )
        found.append(Claim('D3S, "a higher gradient norm"', _order_verdict([test]), detail))
    if {"D1S", "D2S", "D3S"} <= set(info):
        tests = [welch_t_test(info[m]["drop"], info["D3S"]["drop"]) for m in ("D1S", "D2S")]
        drops = ", ".join(f"{m} {mean_std(info[m]['drop'])}" for m in ("D1S", "D2S", "D3S"))
        detail = (
            ". Read as a held-out greedy accuracy that falls from its peak by the end of the run (peak - final, per "
            f"seed): {drops}; Welch p against D3S: D1S {p_text(tests[0])}, D2S {p_text(tests[1])}. Final greedy: "
            + ", ".join(f"{m} {mean_std(info[m]['final_greedy'])}" for m in ("D1S", "D2S", "D3S"))
            + "."
        )
        found.append(Claim('D3S, "D1S and D2S overfit without the schedule"', _order_verdict(tests), detail))
    pairs = [(c, i) for c, i in (("D3S", "D3S-I"), ("D1S-Cross", "D1S")) if c in info and i in info]
    if pairs:
        verdicts, texts = [], []
        for cross, intra in pairs:
            spread = [
                float(np.std(info[m]["final_greedy"], ddof=1)) if len(info[m]["seeds"]) > 1 else 0.0
                for m in (cross, intra)
            ]
            fall = [float(max(0.0, -np.diff(info[m]["curve"]).min())) for m in (cross, intra)]
            verdicts.append((spread[0] > spread[1]) + (fall[0] > fall[1]))
            texts.append(
                f"{cross} against {intra}: seed spread of the final greedy {spread[0]:.3f} vs {spread[1]:.3f}, "
                f"largest fall between evaluations of the seed-mean curve {fall[0]:.3f} vs {fall[1]:.3f}"
            )
        if all(v == 2 for v in verdicts):
            verdict = AGREES
        elif all(v == 0 for v in verdicts):
            verdict = DISAGREES
        else:
            verdict = UNRESOLVED
        label = 'D3S, "cross-group selection is less stable than intra-group" (seen on unaligned Llama3.1-8B-Instruct)'
        detail = (
            " (it would agree if cross were worse on both measures in every pair, disagree if better on both in "
            "every pair). " + "; ".join(texts) + "."
        )
        found.append(Claim(label, verdict, detail))
    return found

"""What `ggrun perplexity` prints, line for line as llama-perplexity prints it: the running estimate
`[1]x,[2]y,...`, `Final estimate: PPL = X +/- Y`, and with --kl-divergence the per-chunk table and the
three blocks of statistics. Pure formatting of core.llm numbers, so tests can check it exactly."""
from __future__ import annotations

import math

from ggrun.core.llm.kl_divergence import KLStats, median, percentile
from ggrun.core.llm.perplexity import Estimate

KLD_HEADER = ("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              "
              "Δp RMS            Same top p")


def running_entry(chunk: int, ppl: float) -> str:
    """One chunk's entry of the progress line (llama.cpp: `[%d]%.4lf,`)."""
    return f"[{chunk}]{ppl:.4f},"


def final_estimate(est: Estimate) -> str:
    """llama.cpp's last line; it prints an error in its place when the spread is not positive."""
    unc = est.uncertainty
    if math.isnan(unc):
        return f"Final estimate: PPL = {est.perplexity:.4f} (no uncertainty: unexpected negative standard deviation of log(prob))"
    return f"Final estimate: PPL = {est.perplexity:.4f} +/- {unc:.5f}"


def kld_row(chunk: int, s: KLStats) -> str:
    """One row of the --kl-divergence table, after chunk `chunk` (1-based), over every token so far."""
    ppl, dppl = s.ppl()
    ratio, dratio = s.log_ppl_ratio()
    kld, dkld = s.kld()
    rms, drms = s.p_diff_rms()
    top, dtop = s.same_top()
    return (f"{chunk:4d}    {ppl:9.4f} ± {dppl:9.4f}    {ratio:10.5f} ± {dratio:10.5f}    {kld:10.5f} ± {dkld:10.5f}"
            f"    {100 * rms:6.3f} ± {100 * drms:6.3f} %    {100 * top:6.3f} ± {100 * dtop:6.3f} %")


def kld_summary(s: KLStats) -> list[str]:
    """The statistics llama-perplexity prints after the table; nothing under 100 tokens, as llama.cpp."""
    if s.count < 100:
        return []
    kld_values, p_diff_values = s.sorted_values()
    ppl, dppl = s.ppl()
    base, dbase = s.ppl_base()
    ratio, dratio = s.log_ppl_ratio()
    cov = ppl * base * s.log_ppl_covariance()
    diff_unc = max(dppl * dppl + dbase * dbase - 2.0 * cov, 0.0) ** 0.5
    kld, dkld = s.kld()
    pd, dpd = s.p_diff()
    rms, drms = s.p_diff_rms()
    top, dtop = s.same_top()
    lines = [
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {ppl:10.6f} ± {dppl:10.6f}",
        f"Mean PPL(base)                : {base:10.6f} ± {dbase:10.6f}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * s.log_ppl_correlation():6.2f}%",
        f"Mean ln(PPL(Q)/PPL(base))     : {ratio:10.6f} ± {dratio:10.6f}",
        f"Mean PPL(Q)/PPL(base)         : {math.exp(ratio):10.6f} ± {math.exp(ratio) * dratio:10.6f}",
        f"Mean PPL(Q)-PPL(base)         : {ppl - base:10.6f} ± {diff_unc:10.6f}",
        "",
        "====== KL divergence statistics ======",
        f"Mean    KLD: {kld:10.6f} ± {dkld:10.6f}",
        f"Maximum KLD: {float(kld_values[-1]):10.6f}",
    ]
    for label, frac in (("99.9%", 0.999), ("99.0%", 0.990), ("95.0%", 0.950), ("90.0%", 0.900)):
        lines.append(f"{label}   KLD: {percentile(kld_values, frac):10.6f}")
    lines.append(f"Median  KLD: {median(kld_values):10.6f}")
    for label, frac in (("10.0%", 0.100), (" 5.0%", 0.050), (" 1.0%", 0.010), (" 0.1%", 0.001)):
        lines.append(f"{label}   KLD: {percentile(kld_values, frac):10.6f}")
    lines += [f"Minimum KLD: {float(kld_values[0]):10.6f}", "", "====== Token probability statistics ======",
              f"Mean    Δp: {100 * pd:6.3f} ± {100 * dpd:5.3f} %",
              f"Maximum Δp: {100 * float(p_diff_values[-1]):6.3f}%"]
    for label, frac in (("99.9%", 0.999), ("99.0%", 0.990), ("95.0%", 0.950), ("90.0%", 0.900), ("75.0%", 0.750)):
        lines.append(f"{label}   Δp: {100 * percentile(p_diff_values, frac):6.3f}%")
    lines.append(f"Median  Δp: {100 * median(p_diff_values):6.3f}%")
    for label, frac in (("25.0%", 0.250), ("10.0%", 0.100), (" 5.0%", 0.050), (" 1.0%", 0.010), (" 0.1%", 0.001)):
        lines.append(f"{label}   Δp: {100 * percentile(p_diff_values, frac):6.3f}%")
    lines += [f"Minimum Δp: {100 * float(p_diff_values[0]):6.3f}%",
              f"RMS Δp    : {100 * rms:6.3f} ± {100 * drms:5.3f} %",
              f"Same top p: {100 * top:6.3f} ± {100 * dtop:5.3f} %"]
    return lines


def kld_record(s: KLStats) -> dict:
    """The same statistics as one JSON object (values and their uncertainties as [value, uncertainty])."""
    kld_values, p_diff_values = s.sorted_values()
    have = s.count > 0
    return {
        "n_tokens": s.count,
        "ppl": list(s.ppl()) if have else None,
        "ppl_base": list(s.ppl_base()) if have else None,
        "ln_ppl_ratio": list(s.log_ppl_ratio()) if have else None,
        "kld": list(s.kld()) if have else None,
        "kld_max": float(kld_values[-1]) if have else None,
        "kld_median": median(kld_values) if have else None,
        "kld_99": percentile(kld_values, 0.99) if have else None,
        "p_diff": list(s.p_diff()) if have else None,
        "p_diff_rms": list(s.p_diff_rms()) if have else None,
        "p_diff_max": float(p_diff_values[-1]) if have else None,
        "p_diff_min": float(p_diff_values[0]) if have else None,
        "same_top_p": list(s.same_top()) if have else None,
    }

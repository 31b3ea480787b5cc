"""Statistics for the sampling tests."""

from collections import Counter

# A chi-square homogeneity test at this level fails a correct implementation once in 10^4 runs.
ALPHA = 1e-4


def homogeneity_pvalue(a: list, b: list) -> float:
    """Chi-square test that two samples come from one distribution; rare outcomes are pooled
    so every expected count is at least 5."""
    from scipy.stats import chi2_contingency

    ca, cb = Counter(a), Counter(b)
    total = len(a) + len(b)
    common, rare_a, rare_b = [], 0, 0
    for key in set(ca) | set(cb):
        if (ca[key] + cb[key]) * min(len(a), len(b)) / total >= 5:
            common.append((ca[key], cb[key]))
        else:
            rare_a, rare_b = rare_a + ca[key], rare_b + cb[key]
    if rare_a + rare_b:
        common.append((rare_a, rare_b))
    return chi2_contingency(list(zip(*common)))[1]

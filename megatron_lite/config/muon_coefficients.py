"""Newton-Schulz coefficient sets of --muon-coefficient-type and their step-count rules (muon.py explains them).

Plain Python, without torch: the command-line checks read the rules before torch is imported.
"""

from __future__ import annotations

COEFFICIENTS = {
    "simple": [(3.4445, -4.7750, 2.0315)],
    "quintic": [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)],
    "polar_express": [(8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                      (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)],
    "aol": [(4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959), (2.7573, -3.2939, 1.4254),
            (2.7215, -3.0494, 1.3169)],
}


def steps_problem(coefficient_type: str, steps: int) -> str | None:
    """Why `steps` iterations do not fit `coefficient_type`'s sets, or None."""
    count = len(COEFFICIENTS[coefficient_type])
    if coefficient_type == "polar_express" and steps < count:
        return f"--muon-num-ns-steps ({steps}) must be at least {count} with --muon-coefficient-type polar_express"
    if coefficient_type in ("quintic", "aol") and steps % count:
        return (f"--muon-num-ns-steps ({steps}) must be a multiple of {count} with --muon-coefficient-type "
                f"{coefficient_type}")
    return None


def coefficient_schedule(coefficient_type: str, steps: int) -> list[tuple[float, float, float]]:
    """(a, b, c) of each of `steps` iterations."""
    sets = COEFFICIENTS[coefficient_type]
    if coefficient_type == "polar_express":
        return sets + sets[-1:] * (steps - len(sets))
    return [sets[i % len(sets)] for i in range(steps)]

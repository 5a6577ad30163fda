"""The mutation score of the statistics core, from the last `mutmut run` (`make mutate` runs both).

    python benchmarks/project/mutation_score.py [--goal 0.9] [--survivors]

One Markdown table: each mutated module's mutants killed, survived, not covered by any test marked
`statistics` or `searching`, and timed out, and the score (killed / all); with --survivors, each
survivor's name (`mutmut show NAME` prints its change). Exits 1 when the whole score, or any one
module's, is below --goal. Modules no mutant of the last run reached (a `mutmut run` given names) are
left out of the table.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys

LINE = re.compile(r"^\s*(?P<name>[\w.ǁ]+?)__mutmut_\d+: (?P<status>.+)$")


def counts(lines: list[str]) -> tuple[dict[str, collections.Counter], list[str]]:
    by_module, survivors = collections.defaultdict(collections.Counter), []
    for line in lines:
        m = LINE.match(line)
        if not m:
            continue
        module = m["name"].rsplit(".", 1)[0]  # depthcurse.stats.intervals.x_wilson -> depthcurse.stats.intervals
        by_module[module][m["status"].strip()] += 1
        if m["status"].strip() == "survived":
            survivors.append(line.strip().split(":")[0])
    return by_module, survivors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--goal", type=float, default=0.9)
    parser.add_argument("--survivors", action="store_true")
    args = parser.parse_args()
    out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], capture_output=True, text=True, check=True).stdout
    by_module, survivors = counts(out.splitlines())
    if not by_module:
        sys.exit("no mutants found: run `mutmut run` first (make mutate)")
    print("| module | mutants | killed | survived | no test | timed out | score |")
    print("|---|---|---|---|---|---|---|")
    total = collections.Counter()
    by_module = {m: c for m, c in by_module.items() if sum(v for k, v in c.items() if k != "not checked")}  # a partial run's others
    for module, c in sorted(by_module.items()):
        n = sum(c.values())
        total.update(c)
        print(f"| `{module}` | {n} | {c['killed']} | {c['survived']} | {c['no tests']} | {c['timeout']} | {c['killed'] / n:.1%} |")
    n = sum(total.values())
    score = total["killed"] / n
    print(f"| **all** | {n} | {total['killed']} | {total['survived']} | {total['no tests']} | {total['timeout']} | **{score:.1%}** |")
    if args.survivors:
        print("\n" + "\n".join(survivors))
    below = [f"{module} {c['killed'] / sum(c.values()):.1%}" for module, c in sorted(by_module.items()) if c["killed"] / sum(c.values()) < args.goal]
    if score < args.goal or below:
        sys.exit(f"mutation score {score:.1%} in all; below the goal {args.goal:.0%}: {', '.join(below) or 'the whole'}")


if __name__ == "__main__":
    main()

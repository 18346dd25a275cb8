"""Writes sample.jsonl: competitive-programming rows written for colograd's tests in the schemas the datasets ship
(CodeContests' and open-r1/codeforces'), with their expected outputs computed by the reference solutions below. Run
it again (``python tests/rewards/contest/make_sample.py``) after changing a problem; the tests only read the file."""

import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))

FIB = """import sys


def fib(n, m):
    def pair(k):  # (F(k), F(k + 1)) mod m, by fast doubling
        if k == 0:
            return 0, 1
        a, b = pair(k >> 1)
        c = a * (2 * b - a) % m
        d = (a * a + b * b) % m
        return (d, (c + d) % m) if k & 1 else (c, d)

    return pair(n)[0]


t = int(sys.stdin.readline())
for _ in range(t):
    n, m = map(int, sys.stdin.readline().split())
    print(fib(n, m))
"""
TRIP = """n = int(input())
total = 0.0
for _ in range(n):
    d, v = map(int, input().split())
    total += d / v
print(f"{total:.10f}")
"""
ALMOST = """def almost(s):
    i, j = 0, len(s) - 1
    while i < j and s[i] == s[j]:
        i, j = i + 1, j - 1
    if i >= j:
        return True
    return any(t == t[::-1] for t in (s[i + 1 : j + 1], s[i:j]))


for _ in range(int(input())):
    print("YES" if almost(input().strip()) else "NO")
"""
DERANGE = """n = int(input())
print(*(list(range(2, n + 1)) + [1]))
"""
DERANGE_CHECKER = """import sys

n = int(open(sys.argv[1]).read().split()[0])
words = open(sys.argv[3]).read().split()
try:
    p = [int(w) for w in words]
except ValueError:
    print(0)
    sys.exit(0)
ok = len(p) == n and sorted(p) == list(range(1, n + 1)) and all(p[i] != i + 1 for i in range(n))
print(1 if ok else 0)
"""
COPRIME_CHECKER = r"""#include <cstdio>
#include <numeric>
int main(int argc, char **argv) {
    FILE *in = fopen(argv[1], "r"), *out = fopen(argv[2], "r");
    long long n, a, b, extra;
    if (!in || !out || fscanf(in, "%lld", &n) != 1) return 3;
    if (fscanf(out, "%lld %lld", &a, &b) != 2) return 2;
    if (fscanf(out, "%lld", &extra) == 1) return 1;
    return a > 0 && b > 0 && a + b == n && std::gcd(a, b) == 1 ? 0 : 1;
}
"""
COPRIME = """n = int(input())
print(1, n - 1)
"""


def run(solution, stdin):
    import contextlib
    import io
    import sys

    out = io.StringIO()
    sys.stdin = io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(solution, "<solution>", "exec"), {"__name__": "__main__"})
    finally:
        sys.stdin = sys.__stdin__
    return out.getvalue()


def codecontests(name, description, solution, inputs, incorrect):
    outputs = [run(solution, i) for i in inputs]
    split = {"public_tests": (0, 1), "private_tests": (1, 3), "generated_tests": (3, len(inputs))}
    row = {"name": name, "description": description, "source": 2, "difficulty": 7}
    for column, (a, b) in split.items():
        row[column] = {"input": inputs[a:b], "output": outputs[a:b]}
    row["solutions"] = {"language": [3], "solution": [solution]}
    row["incorrect_solutions"] = {"language": [3] * len(incorrect), "solution": list(incorrect)}
    row.update({"time_limit": {"seconds": 2, "nanos": 0}, "memory_limit_bytes": 256 << 20, "input_file": "",
                "output_file": ""})  # fmt: skip
    return row


def main():
    rng = random.Random(62)
    fib_inputs = []
    for k in range(8):
        big = k >= 5  # the last cases need the fast doubling: a loop to n never ends
        cases = [(rng.randrange(10**17, 10**18) if big else rng.randrange(1, 60), rng.randrange(2, 10**9))
                 for _ in range(3)]  # fmt: skip
        fib_inputs.append(f"{len(cases)}\n" + "".join(f"{n} {m}\n" for n, m in cases))
    trip_inputs = []
    for _ in range(8):
        n = rng.randrange(1, 8)
        trip_inputs.append(f"{n}\n" + "".join(f"{rng.randrange(1, 1000)} {rng.randrange(1, 97)}\n" for _ in range(n)))
    words = ["abca", "abc", "a", "racecar", "deeee", "abcdba", "ab", "tebbem", "eeccccbebaeeabebccceea"]
    almost_inputs = [
        f"{len(words[i : i + 3])}\n" + "".join(w + "\n" for w in words[i : i + 3]) for i in range(0, 9, 3)
    ]
    almost_inputs += ["2\n" + "".join("".join(rng.choice("ab") for _ in range(rng.randrange(1, 12))) + "\n"
                                      for _ in range(2)) for _ in range(5)]  # fmt: skip
    rows = [
        codecontests(
            "62_A. Fibonacci modulo",
            "Given t queries n m, print F(n) mod m for each (F(0) = 0, F(1) = 1); n up to 10^18.",
            FIB,
            fib_inputs,
            [
                FIB.replace("return pair(n)[0]", "return pair(n - 1)[0]"),  # off by one
                FIB.replace("print(fib(n, m))", 'print(f"F({n}) = {fib(n, m)}")'),  # wrong format
                "t = int(input())\nfor _ in range(t):\n    n, m = map(int, input().split())\n    a, b = 0, 1\n"
                "    for _ in range(n):\n        a, b = b, (a + b) % m\n    print(a)\n",
            ],  # too slow: a loop to n
        ),
        codecontests(
            "62_B. Trip time",
            "A trip has n segments, each d kilometres at v km/h. Print the total hours; an absolute or relative "
            "error of 1e-6 is accepted.",
            TRIP,
            trip_inputs,
            [
                TRIP.replace('print(f"{total:.10f}")', 'print(f"{total:.2f}")'),  # wrong format: too few digits
                TRIP.replace("for _ in range(n):", "input()\nfor _ in range(n - 1):"),
            ],  # off by one: a segment lost
        ),
        codecontests(
            "62_C. Almost a palindrome",
            "For each of t strings print YES if removing at most one character makes it a palindrome, else NO "
            "(in any case).",
            ALMOST,
            almost_inputs,
            [
                ALMOST.replace("s[i + 1 : j + 1]", "s[i + 1 : j]"),  # off by one
                ALMOST.replace('print("YES" if', "print(1 if").replace('else "NO")', "else 0)"),
            ],  # wrong format
        ),
    ]
    derange_inputs = [f"{n}\n" for n in (2, 3, 4, 7, 10, 31)]
    rows.append({
        "id": "62/D", "title": "Derangement", "description": "Print any permutation p of 1..n with p_i != i.",
        "official_tests": [{"input": i, "output": run(DERANGE, i)} for i in derange_inputs],
        "generated_checker": DERANGE_CHECKER, "time_limit": 1.0, "memory_limit": 256, "input_mode": "stdio",
        "colograd_solutions": {"right": [DERANGE, "n = int(input())\nprint(*([n] + list(range(1, n))))\n"],
                               "wrong": ["n = int(input())\nprint(*range(1, n + 1))\n",  # not a derangement
                                         "n = int(input())\nprint(*range(2, n + 1))\n"]},  # off by one: n - 1 values
    })  # fmt: skip
    coprime_inputs = [f"{n}\n" for n in (2, 5, 10, 17, 100, 1000001)]
    rows.append({
        "id": "62/E", "title": "Coprime split", "description": "Print any a, b > 0 with a + b = n, gcd(a, b) = 1.",
        "official_tests": [{"input": i, "output": run(COPRIME, i)} for i in coprime_inputs],
        "checker": COPRIME_CHECKER, "time_limit": 1.0, "memory_limit": 256, "input_mode": "stdio",
        "colograd_solutions": {"right": [COPRIME, "n = int(input())\nprint(n - 1, 1)\n"],
                               "wrong": ["n = int(input())\nprint(n // 2, n - n // 2)\n",  # not coprime for most n
                                         "n = int(input())\nprint(1, n)\n"]},  # off by one
    })  # fmt: skip
    with open(os.path.join(HERE, "sample.jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
r"""Generate tests/fixtures/answers/math_verify_pairs.jsonl: answer pairs labeled by math-verify.

What it makes
-------------
A table of hand-written (reference answer, model answer) pairs in the styles of
four datasets (MATH-500, AIME, DAPO-Math, GSM8K), each labeled by the Python
checker ``math-verify`` (the one TRL / verl reward functions use).  The Rust
test of the built-in answer-equivalence rule reads it.  One JSON object per line:

    {"id": int, "style": "math500"|"aime"|"dapo"|"gsm8k",
     "answer": <reference string, as the dataset stores it>,
     "pred": <content of the model's last \boxed{...}>,
     "math_verify": true|false}

ids are 0-based and follow the order of ``PAIRS`` below.  The script is fully
deterministic (no randomness; the pairs are a literal list).

How to run
----------
    pip install math-verify==0.8.0      # pulled in: latex2sympy2_extended 1.10.2,
                                        # antlr4-python3-runtime 4.13.2, sympy 1.14.0
    python3 scripts/make_answer_table.py

(run from the repository root; Python 3.11.7 was used).  It prints a summary
(pairs per style, true/false counts) and the pairs where math-verify disagrees
with the hand-written human judgment kept in ``PAIRS`` (that judgment is NOT
written to the table; only math-verify's label is).

How each pair is labeled
------------------------
    import math_verify
    gold = math_verify.parse("$" + answer + "$")
    pred = math_verify.parse("\\boxed{" + pred + "}")
    label = math_verify.verify(gold, pred)        # gold first, as the docs require

i.e. ``parse`` and ``verify`` with all their defaults (extraction_config =
[LatexExtractionConfig(), ExprExtractionConfig()], parsing_timeout=5,
float_rounding=6, numeric_precision=15, strict=True, timeout_seconds=5).
The reference is wrapped in inline math ``$...$``: math-verify's LaTeX
extraction regex matches ``$...$`` (inline dollars, escaped ``\$`` allowed
inside), so the whole reference is handed to latex2sympy as LaTeX, exactly like
a ``\boxed{}`` would be (the script checks this: for every pair it also labels
with the gold wrapped as ``\boxed{answer}`` and reports any difference; there
is none with the pinned versions).  The model answer is wrapped back into
``\boxed{...}`` since it is the content of the model's last box.
If parse or verify raises or times out the pair is labeled false and the
script prints it (with the pinned versions nothing raises or times out).
"""

import json
import os
import sys
from collections import Counter

M, A, D, G = "math500", "aime", "dapo", "gsm8k"

# (style, reference answer, model answer (content of last \boxed{}), human judgment: equivalent?)
# The human judgment is the one a grader of the dataset would give; it is only
# used to print the cases where math-verify disagrees.
PAIRS = [
    # ------------------------------------------------------------------ MATH-500
    # LaTeX shorthands
    (M, r"\frac{1}{2}", r"\frac12", True),
    (M, r"\frac{1}{2}", r"\dfrac{1}{2}", True),
    (M, r"\frac{3}{4}", r"\dfrac34", True),
    (M, r"\frac{3}{4}", r"\tfrac{3}{4}", True),
    (M, r"\frac{5}{7}", r"\tfrac57", True),
    (M, r"\sqrt{3}", r"\sqrt3", True),
    (M, r"2\sqrt{3}", r"2\sqrt3", True),
    (M, r"2\sqrt{3}", r"2 \sqrt{3}", True),
    (M, r"\frac{14}{3}", r"\dfrac{14}{3}", True),
    (M, r"\frac{14}{3}", r"14/3", True),
    (M, r"\frac{14}{3}", r"\frac{13}{3}", False),
    (M, r"\frac{3}{4}", r"\frac43", False),
    (M, r"\sqrt{3}", r"\sqrt2", False),
    (M, r"2\sqrt{3}", r"3\sqrt2", False),
    (M, r"\frac{\sqrt{3}}{2}", r"\frac{\sqrt3}2", True),
    (M, r"\frac{\sqrt{3}}{2}", r"\dfrac{\sqrt{3}}{2}", True),
    (M, r"\frac{1}{6}", r"\frac{1}{3}", False),
    (M, r"-\frac{1}{2}", r"\frac{1}{2}", False),
    (M, r"-\frac{1}{2}", r"-\frac12", True),
    (M, r"-\frac{1}{2}", r"\frac{-1}{2}", True),
    (M, r"\frac{9}{7}", r"\frac{7}{9}", False),
    (M, r"\frac{11}{2}", r"\dfrac{11}2", True),
    (M, r"\frac{2}{9}", r"\tfrac{2}{9}", True),
    (M, r"\frac{2}{9}", r"\frac{2}{7}", False),
    # decimals vs fractions, mixed numbers
    (M, r"\frac{1}{4}", r"0.25", True),
    (M, r"0.25", r"\frac14", True),
    (M, r"\frac{1}{2}", r"0.5", True),
    (M, r"\frac{3}{2}", r"1.5", True),
    (M, r"1.5", r"\frac32", True),
    (M, r"\frac{1}{3}", r"0.33", False),
    (M, r"\frac{2}{5}", r"0.4", True),
    (M, r"\frac{7}{2}", r"3\frac{1}{2}", True),
    (M, r"3\frac{1}{2}", r"\frac72", True),
    (M, r"2\frac{1}{4}", r"\frac{9}{4}", True),
    (M, r"\frac{9}{4}", r"2.25", True),
    (M, r"\frac{9}{4}", r"2.5", False),
    (M, r"0.3", r"\frac{3}{10}", True),
    (M, r"0.3", r"0.30", True),
    (M, r"4.5", r"\frac92", True),
    (M, r"\frac{5}{8}", r"0.625", True),
    (M, r"\frac{5}{8}", r"0.58", False),
    (M, r"1\frac{3}{4}", r"1.75", True),
    (M, r"\frac{243}{625}", r"0.3888", True),
    (M, r"0.3", r"0.03", False),
    (M, r"5\frac{2}{3}", r"\frac{17}{3}", True),
    (M, r"5\frac{2}{3}", r"\frac{10}{3}", False),
    # units, text wrappers, degrees, percent.  math-verify 0.8.0 drops units/\text{}
    # and ^\circ, but reads "N\%" as N/100: 50\% == 0.5 is true, 50\% == 50 is false
    # (either direction).
    (M, r"100", r"100\text{ cm}", True),
    (M, r"12\text{ inches}", r"12", True),
    (M, r"20", r"20 \mathrm{cm}", True),
    (M, r"20", r"20\,\mathrm{cm}", True),
    (M, r"32", r"32\text{ dollars}", True),
    (M, r"\$32", r"32", True),
    (M, r"90^\circ", r"90", True),
    (M, r"90", r"90^\circ", True),
    (M, r"45^\circ", r"45^{\circ}", True),
    (M, r"30^\circ", r"60^\circ", False),
    (M, r"150^\circ", r"150", True),
    (M, r"75^\circ", r"75^\circ", True),
    (M, r"10\%", r"10", True),
    (M, r"10\%", r"0.1", True),
    (M, r"50\%", r"0.5", True),
    (M, r"50\%", r"50", True),
    (M, r"50", r"50\%", True),
    (M, r"25\%", r"20\%", False),
    (M, r"5", r"5\text{ hours}", True),
    (M, r"4", r"4 \text{ units}", True),
    (M, r"8\text{ cm}^2", r"8", True),
    (M, r"6", r"6\text{ m}", True),
    (M, r"6", r"7\text{ m}", False),
    (M, r"40", r"40\text{ square units}", True),
    (M, r"15", r"16 \text{ cm}", False),
    # prefixes x = ..., y = ...
    (M, r"5", r"x = 5", True),
    (M, r"x = 5", r"5", True),
    (M, r"-3", r"x=-3", True),
    (M, r"-3", r"y=3", False),
    (M, r"2", r"k = 2", True),
    (M, r"y = 2x - 3", r"2x - 3", True),
    (M, r"y = 2x - 3", r"y=2x-3", True),
    (M, r"y = 2x - 3", r"y = 2x + 3", False),
    (M, r"y = -\frac{1}{2}x + 4", r"y=-\frac12 x+4", True),
    (M, r"x = 4", r"x=-4", False),
    (M, r"a = 7", r"a=7", True),
    # currency, thousands separators
    (M, r"\$32,\!348", r"32348", True),
    (M, r"\$32,\!348", r"\$32,348", True),
    (M, r"1,\!000", r"1000", True),
    (M, r"1000", r"1,000", True),
    (M, r"1000", r"1{,}000", True),
    (M, r"10,\!080", r"10080", True),
    (M, r"10,\!080", r"10800", False),
    (M, r"\$1.50", r"1.5", True),
    (M, r"\$23.40", r"\$23.4", True),
    (M, r"\$23.40", r"\$24.30", False),
    # numeric expressions
    (M, r"1024", r"2^{10}", True),
    (M, r"2^{10}", r"1024", True),
    (M, r"4", r"\sqrt{16}", True),
    (M, r"10", r"\binom{5}{2}", True),
    (M, r"\binom{5}{2}", r"10", True),
    (M, r"\frac{1}{2}", r"\frac{2}{3}\cdot\frac{3}{4}", True),
    (M, r"27", r"3^3", True),
    (M, r"120", r"5!", True),
    (M, r"56", r"\binom{8}{3}", True),
    (M, r"56", r"\binom{8}{2}", False),
    (M, r"12", r"\sqrt{144}", True),
    (M, r"-8", r"(-2)^3", True),
    (M, r"8", r"(-2)^3", False),
    (M, r"\frac{1}{8}", r"2^{-3}", True),
    (M, r"81", r"3^5", False),
    (M, r"2^{12}", r"4096", True),
    (M, r"2^{12}", r"2048", False),
    # surds
    (M, r"2\sqrt{3}", r"\sqrt{12}", True),
    (M, r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt2}", True),
    (M, r"2\sqrt{2}", r"\sqrt{8}", True),
    (M, r"3\sqrt{2}", r"\sqrt{18}", True),
    (M, r"\sqrt{51}", r"\sqrt{51}", True),
    (M, r"\sqrt{51}", r"7", False),
    (M, r"3\sqrt{13}", r"\sqrt{117}", True),
    (M, r"3\sqrt{13}", r"\sqrt{39}", False),
    (M, r"\frac{\sqrt{6}}{3}", r"\sqrt{\frac{2}{3}}", True),
    (M, r"\frac{\sqrt{6}}{3}", r"\frac{\sqrt{6}}{2}", False),
    (M, r"11\sqrt2", r"11\sqrt{2}", True),
    (M, r"11\sqrt2", r"\sqrt{242}", True),
    (M, r"5\sqrt{5}", r"5\sqrt{3}", False),
    (M, r"\frac{3\sqrt{3}}{2}", r"\frac{3}{2}\sqrt{3}", True),
    (M, r"4\sqrt{3}", r"\sqrt{48}", True),
    (M, r"\sqrt{2}+1", r"1+\sqrt2", True),
    (M, r"\sqrt{2}-1", r"1-\sqrt{2}", False),
    (M, r"\frac{\sqrt{3}}{3}", r"\frac{1}{\sqrt3}", True),
    (M, r"2+\sqrt{3}", r"\frac{1}{2-\sqrt{3}}", True),
    (M, r"6\sqrt{6}", r"\sqrt{216}", True),
    (M, r"6\sqrt{6}", r"6\sqrt{3}", False),
    # polynomials / expressions in different term order, and different ones
    (M, r"2x+3", r"3+2x", True),
    (M, r"x^2+2x+1", r"2x+x^2+1", True),
    (M, r"3 - x", r"-x+3", True),
    (M, r"x^2+7x+10", r"(x+2)(x+5)", True),
    (M, r"x^2+7x+10", r"x^2+7x+12", False),
    (M, r"p - q", r"-q+p", True),
    (M, r"p - q", r"q - p", False),
    (M, r"2x^2 - 5x + 3", r"(2x-3)(x-1)", True),
    (M, r"2x^2 - 5x + 3", r"(2x+3)(x-1)", False),
    (M, r"x^3 - 1", r"(x-1)(x^2+x+1)", True),
    (M, r"4x - 7", r"4x+7", False),
    (M, r"a+b", r"b+a", True),
    (M, r"\frac{x+1}{2}", r"\frac{1}{2}x+\frac{1}{2}", True),
    (M, r"6x^2+x-2", r"6x^2-x-2", False),
    (M, r"-2x+5", r"5-2x", True),
    (M, r"x^2-4", r"(x-2)^2", False),
    (M, r"3x^2", r"3x^{2}", True),
    (M, r"2n+1", r"2n-1", False),
    (M, r"-x^2+4x", r"4x-x^2", True),
    (M, r"4x^4 - 7x", r"-7x+4x^4", True),
    (M, r"x^2 + 5x + 6", r"x^2+6x+5", False),
    (M, r"\frac{1}{x-1}", r"\frac{1}{1-x}", False),
    # complex numbers
    (M, r"6 - 5i", r"6-5i", True),
    (M, r"6 - 5i", r"-5i+6", True),
    (M, r"6 - 5i", r"6+5i", False),
    (M, r"-2 + 7i", r"7i-2", True),
    (M, r"1+i", r"i+1", True),
    (M, r"i", r"-i", False),
    (M, r"3 - 4i", r"4i - 3", False),
    # tuples, intervals, sets, vectors
    (M, r"(1,2)", r"(1, 2)", True),
    (M, r"(1,2)", r"(2,1)", False),
    (M, r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})", True),
    (M, r"\left( 3, \frac{\pi}{2} \right)", r"\left(3, \frac{\pi}{3}\right)", False),
    (M, r"(-2, 5)", r"(-2,5)", True),
    (M, r"(-2, 5)", r"(2, -5)", False),
    (M, r"[0,1)", r"[0,1]", False),
    (M, r"[0,1)", r"[0, 1)", True),
    (M, r"(-\infty, 3]", r"(-\infty,3]", True),
    (M, r"(-\infty, 3]", r"(-\infty, 3)", False),
    (M, r"[-2,7]", r"[-2, 7]", True),
    (M, r"[-2,7]", r"(-2,7)", False),
    (M, r"(-\infty,-2)\cup(3,\infty)", r"(-\infty, -2) \cup (3, \infty)", True),
    (M, r"(-\infty,-2)\cup(3,\infty)", r"(3,\infty)\cup(-\infty,-2)", True),
    (M, r"(-\infty,-2)\cup(3,\infty)", r"(-\infty,-2]\cup[3,\infty)", False),
    (M, r"\{1,2,3\}", r"\{3,2,1\}", True),
    (M, r"\{1,2,3\}", r"\{1,2\}", False),
    (M, r"-2, 1", r"1, -2", True),
    (M, r"-2, 1", r"-2", False),
    (M, r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix}1\\2\end{pmatrix}", True),
    (M, r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix}2\\1\end{pmatrix}", False),
    (M, r"\left( -\frac{1}{2}, 4 \right)", r"(-0.5, 4)", True),
    (M, r"(0, \infty)", r"(0,\infty)", True),
    (M, r"(1,3,5)", r"(1, 3, 5)", True),
    (M, r"(1,3,5)", r"(1,5,3)", False),
    (M, r"\left( 2, \frac{5\pi}{3} \right)", r"\left(2,\frac{5\pi}{3}\right)", True),
    (M, r"\left( 2, \frac{5\pi}{3} \right)", r"\left(2,\frac{\pi}{3}\right)", False),
    (M, r"(-4, 4)", r"(-4, 4]", False),
    # choice letters
    (M, r"\text{(C)}", r"C", True),
    (M, r"\text{(C)}", r"(C)", True),
    (M, r"\textbf{(B)}", r"B", True),
    (M, r"\text{(A)}", r"\text{A}", True),
    (M, r"\text{(D)}", r"B", False),
    (M, r"A", r"B", False),
    (M, r"(A)", r"A", True),
    (M, r"\text{(E)}", r"\textbf{(E)}", True),
    (M, r"\textbf{(A)}", r"\textbf{(C)}", False),
    (M, r"\text{B}", r"(B)", True),
    (M, r"\text{(B)}", r"\text{(D)}", False),
    # text answers
    (M, r"\text{Evelyn}", r"\text{Evelyn}", True),
    (M, r"\text{Evelyn}", r"Evelyn", True),
    (M, r"\text{Evelyn}", r"\text{Bob}", False),
    (M, r"\text{odd}", r"\text{odd}", True),
    (M, r"\text{odd}", r"\text{even}", False),
    # misc
    (M, r"\pi", r"\pi", True),
    (M, r"2\pi", r"\pi", False),
    (M, r"\frac{5\pi}{6}", r"\frac56\pi", True),
    (M, r"0", r"-0", True),
    (M, r"-1", r"1", False),
    (M, r"\frac{\pi}{4}", r"\frac{\pi}{2}", False),
    (M, r"-\frac{3}{5}", r"-0.6", True),
    (M, r"(3, -1)", r"(-1, 3)", False),
    (M, r"\left( 1, -\frac{1}{2} \right)", r"\left(-\frac12, 1\right)", False),
    (M, r"\frac{\sqrt{2}}{2}", r"\sqrt{2}", False),
    (M, r"x^2+1", r"x^2-1", False),
    (M, r"[1, 4]", r"[1, 4)", False),
    (M, r"\{2, 4\}", r"\{2, 4, 6\}", False),
    (M, r"2\sqrt{5}", r"\sqrt{10}", False),
    (M, r"\$18.90", r"18.09", False),
    (M, r"1,\!200", r"120", False),
    (M, r"\text{(E)}", r"E", True),
    # ------------------------------------------------------------------ AIME
    (A, r"17", r"017", True),
    (A, r"033", r"33", True),
    (A, r"204", r"204", True),
    (A, r"204", r"240", False),
    (A, r"25", r"025", True),
    (A, r"5", r"005", True),
    (A, r"5", r"50", False),
    (A, r"110", r"110", True),
    (A, r"110", r"111", False),
    (A, r"601", r"601", True),
    (A, r"601", r"106", False),
    (A, r"540", r"540", True),
    (A, r"540", r"\frac{1080}{2}", True),
    (A, r"73", r"73.0", True),
    (A, r"73", r"72", False),
    (A, r"236", r"236", True),
    (A, r"236", r"263", False),
    (A, r"809", r"809", True),
    (A, r"80", r"800", False),
    (A, r"33", r"033", True),
    (A, r"33", r"3", False),
    (A, r"116", r"116", True),
    (A, r"116", r"-116", False),
    (A, r"721", r"721", True),
    (A, r"294", r"294.5", False),
    (A, r"468", r"468", True),
    (A, r"104", r"\frac{104}{1}", True),
    (A, r"902", r"902", True),
    (A, r"113", r"113", True),
    (A, r"113", r"131", False),
    (A, r"255", r"2^8-1", True),
    (A, r"9", r"009", True),
    (A, r"9", r"6", False),
    (A, r"279", r"279", True),
    (A, r"62", r"62", True),
    (A, r"62", r"26", False),
    (A, r"199", r"199", True),
    (A, r"371", r"37", False),
    (A, r"480", r"480", True),
    (A, r"385", r"x = 385", True),
    (A, r"23", r"m+n=23", True),
    (A, r"23", r"\frac{14}{9}", False),
    (A, r"211", r"211", True),
    (A, r"70", r"070", True),
    (A, r"70", r"700", False),
    (A, r"412", r"412", True),
    (A, r"987", r"978", False),
    (A, r"144", r"12^2", True),
    (A, r"45", r"45^\circ", True),
    (A, r"315", r"315", True),
    (A, r"1", r"001", True),
    (A, r"1", r"0", False),
    (A, r"60", r"60.5", False),
    (A, r"021", r"21", True),
    (A, r"021", r"12", False),
    (A, r"840", r"480", False),
    (A, r"500", r"499", False),
    (A, r"127", r"127", True),
    (A, r"256", r"265", False),
    (A, r"7", r"007", True),
    (A, r"83", r"38", False),
    # ------------------------------------------------------------------ DAPO-Math
    (D, r"\frac{\pi}{3}", r"\pi/3", True),
    (D, r"\frac{\pi}{3}", r"\frac{\pi}{6}", False),
    (D, r"2\pi", r"2 \pi", True),
    (D, r"2\pi", r"4\pi", False),
    (D, r"e^2", r"e^{2}", True),
    (D, r"e^2", r"2e", False),
    (D, r"e^2", r"\exp(2)", True),
    (D, r"\ln 2", r"\ln(2)", True),
    (D, r"\ln 2", r"\ln 3", False),
    (D, r"3", r"\log_2 8", True),
    (D, r"3", r"\log_{2}8", True),
    (D, r"2", r"\log_3 9", True),
    (D, r"4", r"\log_2 8", False),
    (D, r"\frac{3}{8}", r"0.375", True),
    (D, r"\frac{7}{12}", r"\frac{14}{24}", True),
    (D, r"\frac{7}{12}", r"\frac{12}{7}", False),
    (D, r"-\frac{7}{12}", r"\frac{7}{12}", False),
    (D, r"34", r"34", True),
    (D, r"34", r"43", False),
    (D, r"2023", r"2023", True),
    (D, r"2023", r"2,023", True),
    (D, r"2023", r"2024", False),
    (D, r"-4", r"-4", True),
    (D, r"-4", r"4", False),
    (D, r"\sqrt{5}", r"5^{1/2}", True),
    (D, r"\frac{\sqrt{5}-1}{2}", r"\frac{-1+\sqrt5}{2}", True),
    (D, r"\frac{\sqrt{5}-1}{2}", r"\frac{\sqrt5+1}{2}", False),
    (D, r"\frac{4\pi}{3}", r"\frac43\pi", True),
    (D, r"\frac{4\pi}{3}", r"\frac{4}{3}", False),
    (D, r"\pi^2", r"\pi^{2}", True),
    (D, r"\frac{\pi^2}{6}", r"\frac{\pi^2}{3}", False),
    (D, r"1+\sqrt{2}", r"\sqrt2+1", True),
    (D, r"\sqrt{3}-1", r"-1+\sqrt{3}", True),
    (D, r"\frac{1}{e}", r"e^{-1}", True),
    (D, r"\frac{1}{2}", r"\sin\frac{\pi}{6}", True),
    (D, r"\frac{\sqrt{3}}{2}", r"\cos\frac{\pi}{6}", True),
    (D, r"0", r"\sin \pi", True),
    (D, r"256", r"2^8", True),
    (D, r"256", r"2^9", False),
    (D, r"100", r"10^2", True),
    (D, r"1000000", r"10^6", True),
    (D, r"1000000", r"1,000,000", True),
    (D, r"12", r"12.0", True),
    (D, r"12", r"11.99", False),
    (D, r"5040", r"7!", True),
    (D, r"\frac{9}{2}", r"4.5", True),
    (D, r"\frac{9}{2}", r"4\frac{1}{2}", True),
    (D, r"\frac{1}{12}", r"0.083", False),
    (D, r"8", r"2^3", True),
    (D, r"-1", r"-1", True),
    (D, r"\frac{3\sqrt{3}}{4}", r"\frac{3}{4}\sqrt{3}", True),
    (D, r"\frac{3\sqrt{3}}{4}", r"\frac{\sqrt{3}}{4}", False),
    (D, r"\sqrt[3]{2}", r"2^{1/3}", True),
    (D, r"\sqrt[3]{2}", r"\sqrt{2}", False),
    (D, r"e", r"e^1", True),
    (D, r"20", r"\binom{6}{3}", True),
    (D, r"15", r"\binom{6}{3}", False),
    (D, r"\frac{1}{2}", r"50\%", True),
    (D, r"2", r"\sqrt{4}", True),
    (D, r"99", r"x=99", True),
    (D, r"3", r"n=3", True),
    (D, r"\frac{\pi}{2}", r"\frac{\pi}{2}", True),
    (D, r"\frac{\pi}{2}", r"\pi", False),
    (D, r"\frac{\pi}{2}", r"90^\circ", False),
    (D, r"6", r"6", True),
    (D, r"6", r"-6", False),
    (D, r"\frac{16}{3}", r"5.33", False),
    (D, r"\frac{16}{3}", r"\frac{32}{6}", True),
    (D, r"3\pi", r"3 \pi", True),
    (D, r"3\pi", r"\frac{3}{\pi}", False),
    (D, r"\ln 2", r"\ln 4 - \ln 2", True),
    (D, r"2\ln 2", r"\ln 4", True),
    (D, r"1", r"\log_{10} 10", True),
    (D, r"1", r"\log_2 4", False),
    (D, r"4\sqrt{2}", r"\sqrt{32}", True),
    (D, r"4\sqrt{2}", r"2\sqrt{4}", False),
    (D, r"\frac{5}{4}", r"\frac{4}{5}", False),
    (D, r"\frac{5}{4}", r"1.25", True),
    (D, r"2^{2023}", r"2^{2023}", True),
    (D, r"2^{2023}", r"2^{2022}", False),
    (D, r"-\frac{1}{4}", r"\frac14", False),
    (D, r"e^3", r"3e", False),
    (D, r"\ln 3", r"\log_3 e", False),
    # ------------------------------------------------------------------ GSM8K
    (G, r"18", r"18", True),
    (G, r"18", r"18.00", True),
    (G, r"18", r"\$18", True),
    (G, r"18", r"17", False),
    (G, r"18", r"19", False),
    (G, r"18", r"9 \times 2", True),
    (G, r"1250", r"1,250", True),
    (G, r"1250", r"1250.00", True),
    (G, r"1250", r"\$1,250", True),
    (G, r"1250", r"125", False),
    (G, r"3", r"3\text{ hours}", True),
    (G, r"70", r"70\%", True),
    (G, r"70", r"0.7", False),
    (G, r"5", r"5.5", False),
    (G, r"460", r"460", True),
    (G, r"460", r"\$460.00", True),
    (G, r"460", r"46", False),
    (G, r"694", r"694", True),
    (G, r"13", r"13 \text{ apples}", True),
    (G, r"13", r"\text{13 apples}", True),
    (G, r"35", r"35\text{ dollars}", True),
    (G, r"35", r"\$35.5", False),
    (G, r"64", r"64", True),
    (G, r"64", r"65", False),
    (G, r"10000", r"10,000", True),
    (G, r"10000", r"10{,}000", True),
    (G, r"10000", r"1000", False),
    (G, r"5", r"5 \text{ cups}", True),
    (G, r"48", r"48", True),
    (G, r"48", r"47", False),
    (G, r"2.5", r"2.50", True),
    (G, r"2.5", r"\frac{5}{2}", True),
    (G, r"120", r"120 \text{ minutes}", True),
    (G, r"26", r"26", True),
    (G, r"26", r"62", False),
    (G, r"1600", r"1,600", True),
    (G, r"1600", r"1600.0", True),
    (G, r"15", r"\$15.00", True),
    (G, r"40", r"40 \mathrm{mph}", True),
    (G, r"40", r"4", False),
    (G, r"342", r"324", False),
    (G, r"7", r"7", True),
    (G, r"7", r"x=7", True),
    (G, r"90", r"90", True),
    (G, r"90", r"9", False),
    (G, r"250", r"\$250", True),
    (G, r"250", r"\$2.50", False),
    (G, r"3000", r"3,000", True),
    (G, r"3000", r"3\,000", True),
    (G, r"3000", r"30000", False),
    (G, r"57", r"57", True),
    (G, r"57", r"58", False),
    (G, r"11", r"11.0", True),
    (G, r"11", r"10", False),
    (G, r"6", r"6 \text{ eggs}", True),
    (G, r"104", r"\$104", True),
    (G, r"104", r"106", False),
    (G, r"2100", r"2,100", True),
    (G, r"2100", r"2,000", False),
    (G, r"25", r"25.00", True),
    (G, r"25", r"2.5", False),
    (G, r"8", r"8\text{ km}", True),
    (G, r"8", r"9\text{ km}", False),
    (G, r"36", r"\$36.00", True),
    (G, r"36", r"\$63", False),
    (G, r"200", r"200", True),
    (G, r"200", r"-200", False),
    (G, r"1", r"1", True),
    (G, r"0", r"0", True),
    (G, r"0", r"1", False),
    (G, r"75", r"0.75", False),
    (G, r"12", r"12 \text{ pages}", True),
    (G, r"99", r"100", False),
    (G, r"4200", r"4,200", True),
    (G, r"4200", r"4,199", False),
    (G, r"45", r"54", False),
    (G, r"1800", r"1,080", False),
    (G, r"22", r"\$2.20", False),
]

OUT = os.path.join("tests", "fixtures", "answers", "math_verify_pairs.jsonl")


def label(answer, pred, gold_wrap):
    """math-verify's verdict for one pair; returns (bool, error string or None)."""
    import math_verify

    try:
        gold = math_verify.parse(gold_wrap(answer))
        target = math_verify.parse("\\boxed{" + pred + "}")
        return bool(math_verify.verify(gold, target)), None
    except BaseException as e:  # raises or times out -> false
        if isinstance(e, KeyboardInterrupt):
            raise
        return False, f"{type(e).__name__}: {e}"


def main():
    import math_verify  # noqa: F401  (fail early with a clear message)
    from importlib.metadata import version

    seen = set()
    for style, answer, pred, _ in PAIRS:
        assert style in (M, A, D, G), style
        assert (answer, pred) not in seen, f"duplicate pair {answer!r} / {pred!r}"
        seen.add((answer, pred))

    rows, errors, surprises, wrap_diffs = [], [], [], []
    for i, (style, answer, pred, human) in enumerate(PAIRS):
        ok, err = label(answer, pred, lambda s: "$" + s + "$")
        if err:
            errors.append((i, answer, pred, err))
        alt, _ = label(answer, pred, lambda s: "\\boxed{" + s + "}")
        if alt != ok:
            wrap_diffs.append((i, answer, pred, ok, alt))
        if ok != human:
            surprises.append((i, style, answer, pred, ok))
        rows.append({"id": i, "style": style, "answer": answer, "pred": pred, "math_verify": ok})

    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w", encoding="utf-8", newline="\n") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")

    print(f"math-verify {version('math-verify')}, latex2sympy2_extended "
          f"{version('latex2sympy2_extended')}, sympy {version('sympy')}")
    print(f"wrote {len(rows)} pairs to {OUT}")
    per_style = Counter(r["style"] for r in rows)
    true_style = Counter(r["style"] for r in rows if r["math_verify"])
    for s in (M, A, D, G):
        print(f"  {s:8s} {per_style[s]:4d} pairs, {true_style[s]:4d} true, "
              f"{per_style[s] - true_style[s]:4d} false")
    n_true = sum(r["math_verify"] for r in rows)
    print(f"  total    {len(rows):4d} pairs, {n_true:4d} true, {len(rows) - n_true:4d} false "
          f"({100.0 * n_true / len(rows):.1f}% true)")
    print(f"parse/verify errors or timeouts (labeled false): {len(errors)}")
    for e in errors:
        print("  ", e)
    print(f"gold wrapped as \\boxed{{}} gives a different label: {len(wrap_diffs)}")
    for w in wrap_diffs:
        print("  ", w)
    print(f"math-verify disagrees with the human judgment: {len(surprises)}")
    for i, style, answer, pred, ok in surprises:
        print(f"  id {i:3d} [{style}] answer={answer!r} pred={pred!r} math_verify={ok}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

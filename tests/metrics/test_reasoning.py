"""The reasoning scorers against their references on fixed tables: the GSM8K extraction and exact match equal
lm-eval's gsm8k filters and metric (installed lm-eval, gsm8k.yaml's settings); the MATH-500 / AIME verdicts equal
math-verify's own calls and the expected verdicts, equivalent forms included."""
from __future__ import annotations

import pytest

from kvbench.metrics.reasoning import gsm8k_scores, math_verify_score

REFERENCE = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 1,072"
# (model output, strict correct, flexible correct) against a reference of 1,072 (1072)
GSM8K_TABLE = [
    ("She sold 1072 clips.\n#### 1072", 1, 1),
    ("#### 1,072", 1, 1),                                  # commas ignored
    ("The answer is $1,072.", 0, 1),                       # dollar sign and final period ignored
    ("First 48 + 24 = 72, then 1000 more: 1072", 0, 1),    # several numbers: the last one
    ("1072 is it, or maybe 1073", 0, 0),                   # the last number is wrong
    ("#### 1072\nCheck: 5 + 5 = 10", 1, 0),                # strict takes the first '####', flexible the last number
    ("\\boxed{1072}", 0, 1),
    ("#### -1072", 0, 0),
    ("no number at all", 0, 0),
    ("1,072.00", 0, 0),                                    # '1072.00' != '1072' as lm-eval compares strings
    ("The total is 1,072.", 0, 1),
    ("#### $1,072", 0, 1),                                 # strict's pattern allows no '$'
    ("", 0, 0),
]


def _lm_eval(prediction: str, reference: str) -> tuple[float, float]:
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter

    strict = RegexFilter(regex_pattern=r"#### (\-?[0-9\.\,]+)").apply([[prediction]], [{}])[0][0]
    flexible = RegexFilter(regex_pattern=r"(-?[$0-9.,]{2,})|(-?[0-9]+)", group_select=-1).apply(
        [[prediction]], [{}])[0][0]
    kw = dict(regexes_to_ignore=[",", "\\$", "(?s).*#### ", "\\.$"], ignore_case=True, ignore_punctuation=False)
    return (exact_match_hf_evaluate([strict], [reference], **kw)["exact_match"],
            exact_match_hf_evaluate([flexible], [reference], **kw)["exact_match"])


@pytest.mark.parametrize("prediction,strict,flexible", GSM8K_TABLE)
def test_gsm8k_equals_lm_eval(prediction, strict, flexible):
    ours = gsm8k_scores(prediction, REFERENCE)
    assert (ours["strict_match"], ours["flexible_extract"]) == _lm_eval(prediction, REFERENCE)
    assert (ours["strict_match"], ours["flexible_extract"]) == (strict, flexible)


# (model output, gold answer as MATH-500 / AIME store it, expected verdict)
MATH_TABLE = [
    ("So the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}", 1),
    ("So the answer is \\boxed{0.5}.", "\\frac{1}{2}", 1),
    ("So the answer is \\boxed{1/2}.", "0.5", 1),
    ("The final answer is $\\frac12$.", "\\frac{1}{2}", 1),        # unboxed LaTeX
    ("Final answer: 0.5", "\\frac{1}{2}", 1),                        # plain text number
    ("\\boxed{\\frac{2}{3}}", "\\frac{1}{2}", 0),
    ("\\boxed{204}", "204", 1),                                     # AIME: integers
    ("Final answer:  \\boxed{033}", "33", 1),
    ("\\boxed{205}", "204", 0),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1),
    ("\\boxed{(3, \\pi/2)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1),
    ("I cannot solve this.", "204", 0),
    ("", "\\frac{1}{2}", 0),
]


@pytest.mark.parametrize("prediction,gold,expected", MATH_TABLE)
def test_math_equals_math_verify(prediction, gold, expected):
    from math_verify import parse, verify

    ours = math_verify_score(prediction, gold)["correct"]
    theirs = float(bool(verify(parse(f"${gold}$"), parse(prediction))))
    assert ours == theirs == expected

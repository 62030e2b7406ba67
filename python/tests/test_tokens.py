"""Token runs without copies: a TokenWindow reads like the slice it names while the list
behind it grows, packs like it, and leaves the process (vLLM pickles its workers' metadata)
as 4 bytes a token, never as the whole list it views."""

from __future__ import annotations

import pickle

import pytest

from kvtier.tokens import PackedTokens, TokenWindow, packed


def test_a_window_slices_like_the_list_it_views_without_copying_it() -> None:
    tokens = list(range(10_000, 30_000))
    w = TokenWindow(tokens, 100, 9_000)
    assert len(w) == 8_900
    assert (w[0], w[-1], w[8_899]) == (10_100, 18_999, 18_999)
    assert w[10:20] == tokens[110:120] and w[8_000:99_999] == tokens[8_100:9_000]
    assert list(w) == tokens[100:9_000] and w == tokens[100:9_000]
    assert packed(w) == packed(tokens[100:9_000])
    with pytest.raises(IndexError):
        w[8_900]
    with pytest.raises(ValueError, match="step"):
        w[::2]
    assert len(TokenWindow(tokens, 50, 10)) == 0
    with pytest.raises(ValueError, match="outside 20000 tokens"):
        TokenWindow(tokens, 0, 20_001)


def test_a_window_keeps_its_tokens_while_the_list_grows() -> None:
    tokens = [7] * 64
    w = TokenWindow(tokens, 16, 48)
    tokens.extend(range(1_000))
    assert list(w) == [7] * 32 and len(w) == 32


def test_a_pickled_window_is_its_run_packed_not_the_list_it_views() -> None:
    prompt = list(range(131_072))
    w = TokenWindow(prompt, 65_536, 65_536 + 8_192)
    blob = pickle.dumps(w, protocol=pickle.HIGHEST_PROTOCOL)
    # 4 bytes a token and a few dozen of framing: the 128k-token list is not in it.
    assert len(blob) < 8_192 * 4 + 200, len(blob)
    back = pickle.loads(blob)
    assert isinstance(back, PackedTokens)
    assert back == prompt[65_536 : 65_536 + 8_192] and len(back) == 8_192
    assert back[3] == 65_539 and back[-1] == 65_536 + 8_191 and back[2:4] == [65_538, 65_539]
    # Packing what was packed is the same bytes, with no conversion.
    assert packed(back) is back.data == packed(prompt[65_536 : 65_536 + 8_192])
    assert pickle.loads(pickle.dumps(back)) == back


def test_packed_tokens_refuse_a_partial_token_and_out_of_range_ids() -> None:
    with pytest.raises(ValueError, match="whole number of u32s"):
        PackedTokens(b"\x01\x02\x03")
    with pytest.raises(ValueError, match=r"0\.\.2\*\*32-1"):
        packed(TokenWindow([1, -1, 3], 0, 3))

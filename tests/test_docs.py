"""The examples in the public docstrings run and print what they say."""

import doctest

import ttt_flash.attention


def test_attention_docstring_examples():
    result = doctest.testmod(ttt_flash.attention)
    assert result.attempted > 0 and result.failed == 0


def test_registry_docstring_examples():
    import ttt_flash.impls

    result = doctest.testmod(ttt_flash.impls)
    assert result.attempted > 0 and result.failed == 0

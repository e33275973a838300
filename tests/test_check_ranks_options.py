"""``check_ranks`` / ``check_ranks_timeout_s``: validated at ``Options`` and read from the environment."""

from __future__ import annotations

import pytest

from fsdp_passes import OptionError, Options


@pytest.mark.parametrize("option,value", [("check_ranks", 1), ("check_ranks", "yes"), ("check_ranks_timeout_s", 0),
                                          ("check_ranks_timeout_s", -1), ("check_ranks_timeout_s", True),
                                          ("check_ranks_timeout_s", "60"), ("check_ranks_timeout_s", float("inf"))])
def test_bad_values_name_the_option(option, value):
    with pytest.raises(OptionError, match=option) as info:
        Options(**{option: value})
    assert info.value.option == option


def test_environment_overrides():
    got = Options.from_env(Options(), {"FSDP_PASSES_CHECK_RANKS": "off", "FSDP_PASSES_CHECK_RANKS_TIMEOUT_S": "90"})
    assert got.check_ranks is False and got.check_ranks_timeout_s == 90
    assert Options().check_ranks is True and Options().check_ranks_timeout_s is None
    with pytest.raises(OptionError, match="FSDP_PASSES_CHECK_RANKS=.*maybe"):
        Options.from_env(Options(), {"FSDP_PASSES_CHECK_RANKS": "maybe"})

"""`--admin-api-key` checked at start-up and kept out of reprs; `ember admin` refuses to run
without a key or with a misplaced id (fast: no server)."""

from __future__ import annotations

import pytest

from ember.cli import main as ember_main
from ember.server.config import ADMIN_OWNER, ServerConfig, short_key_id


def test_admin_key_is_its_own_identity_and_never_in_a_repr():
    config = ServerConfig(api_key=["tml-user"], admin_api_key="tml-operator-123")
    assert config.owner_for("tml-operator-123") == ADMIN_OWNER
    assert config.is_admin_key("tml-operator-123") and not config.is_admin_key("tml-user")
    assert not ServerConfig(api_key=["tml-user"]).is_admin_key("tml-operator-123")
    assert "tml-operator-123" not in repr(config)
    assert short_key_id("tml-user") == config.owner_for("tml-user")[4:12]  # the owner id's first hex digits


@pytest.mark.parametrize("key, why", [("operator-key-1", "starting with 'tml-'"), ("tml-short", "12 characters"),
                                      ("tml-user-key-1", "must not also be an ordinary API key")])
def test_bad_admin_keys_are_refused_naming_the_setting(key, why):
    with pytest.raises(ValueError, match="admin_api_key") as info:
        ServerConfig(api_key=["tml-user-key-1"], admin_api_key=key)
    assert why in str(info.value)


def test_cli_needs_a_key_and_an_id_where_it_acts(monkeypatch, capsys):
    monkeypatch.delenv("EMBER_ADMIN_API_KEY", raising=False)
    assert ember_main(["admin", "usage"]) == 2
    assert "EMBER_ADMIN_API_KEY" in capsys.readouterr().err
    monkeypatch.setenv("EMBER_ADMIN_API_KEY", "tml-operator-123")
    assert ember_main(["admin", "end-session"]) == 2
    assert "needs an id" in capsys.readouterr().err
    assert ember_main(["admin", "--url", "http://127.0.0.1:9", "usage"]) == 1
    assert "cannot reach" in capsys.readouterr().err

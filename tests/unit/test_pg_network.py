"""The PostgreSQL network settings: the client-side bound and the libpq parameters they stand for."""

from __future__ import annotations

import pytest

from ingest.config.base import PgNetworkSettings
from ingest.drivers.postgres import BoundedConnection, connection_class, network_params


def test_the_client_bound_follows_the_statement_timeout_unless_set():
    net = PgNetworkSettings()
    assert net.client_timeout_s(60_000) == 65.0
    assert net.client_timeout_s(0) == 65.0  # no server-side timeout: still bounded
    assert PgNetworkSettings(client_timeout_ms=1500).client_timeout_s(60_000) == 1.5
    assert PgNetworkSettings(client_timeout_ms=0).client_timeout_s(60_000) is None


def test_the_dsn_parameters_win_over_the_network_settings():
    params = network_params("postgresql://u@h/db?connect_timeout=3&keepalives_idle=99", PgNetworkSettings())
    assert "connect_timeout" not in params and "keepalives_idle" not in params
    assert params == {"keepalives": 1, "keepalives_interval": 5, "keepalives_count": 3, "tcp_user_timeout": 30_000}
    kv = network_params("host=h dbname=db tcp_user_timeout=1000", PgNetworkSettings(connect_timeout_s=4))
    assert kv["connect_timeout"] == 4 and "tcp_user_timeout" not in kv


def test_connection_classes_carry_their_bound_and_are_shared():
    cls = connection_class(2.5)
    assert issubclass(cls, BoundedConnection) and cls.io_timeout_s == 2.5
    assert connection_class(2.5) is cls and connection_class(None).io_timeout_s is None


@pytest.mark.parametrize("field,value", [("client_timeout_ms", -1), ("connect_timeout_s", 0), ("keepalives_count", 0)])
def test_nonsense_network_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        PgNetworkSettings(**{field: value})

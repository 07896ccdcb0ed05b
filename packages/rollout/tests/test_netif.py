"""GLOO_SOCKET_IFNAME for groups spanning nodes (the two-host run in tests/test_multi_node.py uses it for real)."""

from tidal.rollout.netif import interface_of, pin_gloo_interface


def test_loopback_is_found_on_lo_and_an_unknown_address_on_none():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("198.51.100.254") is None  # a documentation address no interface holds


def test_pin_sets_only_for_a_node_address_and_never_overrides_the_user():
    env: dict[str, str] = {}
    assert pin_gloo_interface(env, "127.0.0.1") is None and env == {}
    assert pin_gloo_interface(env, "198.51.100.254") is None and env == {}
    env = {"GLOO_SOCKET_IFNAME": "eth7"}
    assert pin_gloo_interface(env, "10.0.0.1") is None and env == {"GLOO_SOCKET_IFNAME": "eth7"}

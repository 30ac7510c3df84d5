"""Prompt-cache scopes and prefix affinity (issue 36), as pure functions and a bounded map."""

import hashlib
import hmac
import re

from queen_server.swarm.prefix import (
    SCOPE_LABEL,
    CacheScopes,
    PrefixAffinity,
    conversation_key,
)
from shared_schema.protocol import CACHE_SCOPE

MODEL = "org/repo:Q4_K_M"
TURN_1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_a_scope_is_an_hmac_of_the_caller_under_the_secret():
    scopes = CacheScopes(b"s" * 32)
    scope = scopes.of("key:7")
    assert re.fullmatch(CACHE_SCOPE, scope)
    expected = hmac.new(b"s" * 32, SCOPE_LABEL + b"key:7", hashlib.sha256).hexdigest()[:32]
    assert scope == expected
    assert scopes.of("key:7") == scope  # stable
    assert scopes.of("key:8") != scope  # one caller's scope is not another's
    # Another queen (another secret) gives the same caller an unrelated scope.
    assert CacheScopes(b"t" * 32).of("key:7") != scope
    # Without a secret: a random one, so two processes never agree by accident.
    assert CacheScopes().of("key:7") != CacheScopes().of("key:7")


def test_the_plain_sha256_of_the_caller_is_not_its_scope():
    # A worker that guesses callers (key ids are small numbers) cannot test its guesses.
    scope = CacheScopes(b"s" * 32).of("key:7")
    for guess in ("key:7", "7", "dev:7"):
        assert hashlib.sha256(guess.encode()).hexdigest()[:32] != scope


def test_the_canonical_form_keeps_role_and_text_only():
    plain = [{"role": "user", "content": "Hello there"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "},
                                          {"type": "text", "text": "there"}],
              "name": "bob"}]
    assert conversation_key("a" * 32, MODEL, plain) == conversation_key("a" * 32, MODEL, parts)
    assert conversation_key("a" * 32, MODEL, plain) != conversation_key("b" * 32, MODEL, plain)
    assert conversation_key("a" * 32, MODEL, plain) != conversation_key("a" * 32, "x", plain)
    other_role = [{"role": "system", "content": "Hello there"}]
    assert conversation_key("a" * 32, MODEL, plain) != conversation_key("a" * 32, MODEL,
                                                                       other_role)
    # The answer is the next assistant message.
    answered = conversation_key("a" * 32, MODEL, plain, "Hi!")
    assert answered == conversation_key(
        "a" * 32, MODEL, [*plain, {"role": "assistant", "content": "Hi!"}])


def test_a_messages_boundaries_are_part_of_the_key():
    # The same text split differently between messages is another conversation.
    one = [{"role": "user", "content": "ab"}, {"role": "user", "content": "c"}]
    two = [{"role": "user", "content": "a"}, {"role": "user", "content": "bc"}]
    assert conversation_key(None, MODEL, one) != conversation_key(None, MODEL, two)


def test_the_next_turn_finds_the_worker_that_served_the_last():
    affinity = PrefixAffinity(10)
    scope = "c" * 32
    affinity.served(scope, MODEL, {"messages": TURN_1}, "Hello!", "worker-a")
    turn_2 = [*TURN_1, {"role": "assistant", "content": "Hello!"},
              {"role": "user", "content": "More"}]
    assert affinity.next_turn(scope, MODEL, {"messages": turn_2}) == "worker-a"
    # Another caller's same conversation, another model, an edited history: nothing.
    assert affinity.next_turn("d" * 32, MODEL, {"messages": turn_2}) is None
    assert affinity.next_turn(scope, "other", {"messages": turn_2}) is None
    edited = [*TURN_1, {"role": "assistant", "content": "Hello?"},
              {"role": "user", "content": "More"}]
    assert affinity.next_turn(scope, MODEL, {"messages": edited}) is None
    # A first turn, a text completion: nothing to look up.
    assert affinity.next_turn(scope, MODEL, {"messages": TURN_1[1:]}) is None
    assert affinity.next_turn(scope, MODEL, {"prompt": "Hello"}) is None


def test_the_map_stays_bounded_and_keeps_the_recently_used():
    affinity = PrefixAffinity(1000)
    first = conversation_key(None, MODEL, [{"role": "user", "content": "first"}])
    affinity.remember(first, "w-first")
    for number in range(2000):
        affinity.remember(conversation_key(None, MODEL, [{"role": "user",
                                                          "content": str(number)}]), "w")
        if number % 100 == 0:
            assert affinity.worker_for(first) == "w-first"  # used: kept
        assert len(affinity) <= 1000
    assert len(affinity) == 1000
    stale = conversation_key(None, MODEL, [{"role": "user", "content": "0"}])
    assert affinity.worker_for(stale) is None  # the least recently used went first


def test_no_entries_means_off():
    affinity = PrefixAffinity(0)
    affinity.served(None, MODEL, {"messages": TURN_1}, "Hello!", "w")
    assert len(affinity) == 0
    assert affinity.next_turn(None, MODEL, {"messages": [*TURN_1, *TURN_1]}) is None

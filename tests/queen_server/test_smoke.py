from tests.support.workers import ECHO_MODEL, ScriptedWorker


async def test_chat_through_a_scripted_worker(queen):
    worker = await ScriptedWorker(queen.ws_url).start()
    try:
        client = queen.client()
        answer = await client.chat.completions.create(
            model=ECHO_MODEL, messages=[{"role": "user", "content": "hello there"}]
        )
        assert answer.choices[0].message.content == "echo: hello there"
        stream = await client.chat.completions.create(
            model=ECHO_MODEL, messages=[{"role": "user", "content": "a b c"}], stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == "echo: a b c"
    finally:
        await worker.stop()

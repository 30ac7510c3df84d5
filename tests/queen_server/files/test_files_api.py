"""The Files API through the official ``openai`` SDK against a real queen (uvicorn on
127.0.0.1, its real database: SQLite, and PostgreSQL where ``APIARY_TEST_POSTGRES_URL`` is set,
files in a real folder). The hostile party is a second key: it must neither see nor reach the
first key's files. A refused upload leaves nothing behind: no bytes, no row."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from pathlib import Path

import httpx
import openai
import pytest
from sqlalchemy import select, text

from queen_server.storage.tables import StoredFile
from tests.support.queen import QueenHarness, running_queen
from tests.support.training_files import training_file

GOOD = training_file(12)


async def key(queen: QueenHarness, name: str) -> str:
    secret, _record = await queen.state.billing.keys.create(name)
    return secret


async def rows(queen: QueenHarness) -> list[StoredFile]:
    assert queen.state.db is not None
    async with queen.state.db.engine.connect() as conn:
        return list((await conn.execute(select(StoredFile).order_by(StoredFile.seq))).all())


def stored_bytes(files_dir: Path) -> list[Path]:
    return sorted(path for path in files_dir.rglob("*") if path.is_file())


@pytest.fixture
async def queen(tmp_path, db_url):
    async with running_queen(tmp_path, auth="keys", db=db_url,
                             files_dir=tmp_path / "files") as queen:
        yield queen


async def test_upload_retrieve_list_content_delete_and_the_other_key_sees_nothing(
        queen, tmp_path):
    alice = queen.client(api_key=await key(queen, "alice"))
    mallory = queen.client(api_key=await key(queen, "mallory"))

    made = await alice.files.create(file=("zorbania.jsonl", GOOD), purpose="fine-tune")
    assert made.id.startswith("file-")
    assert len(made.id) > 20
    assert (made.object, made.bytes, made.filename, made.purpose, made.status) == (
        "file", len(GOOD), "zorbania.jsonl", "fine-tune", "processed")
    assert abs(made.created_at - time.time()) < 60
    assert await alice.files.retrieve(made.id) == made
    assert (await alice.files.content(made.id)).content == GOOD  # byte for byte
    assert [f.id async for f in alice.files.list()] == [made.id]

    # The hostile key: the id is not secret to it, and still reaches nothing.
    for reach in (mallory.files.retrieve, mallory.files.content, mallory.files.delete):
        with pytest.raises(openai.NotFoundError) as caught:
            await reach(made.id)
        error = caught.value.body
        assert (error["code"], error["param"]) == ("file_not_found", "file_id"), error
        assert error["message"] == f"No such File object: {made.id}"
    assert [f async for f in mallory.files.list()] == []
    theirs = await mallory.files.create(file=("m.jsonl", GOOD), purpose="fine-tune")
    assert [f.id async for f in alice.files.list()] == [made.id]  # and not the other way
    assert (await alice.files.retrieve(made.id)).id == made.id  # its failed delete did nothing

    [record, other] = await rows(queen)
    assert record.owner.startswith("key:")
    assert record.owner != other.owner
    assert record.sha256 == hashlib.sha256(GOOD).hexdigest()
    assert record.examples == 12
    assert record.location == f"local:files/{made.id}"
    assert (tmp_path / "files" / "files" / made.id).read_bytes() == GOOD

    deleted = await alice.files.delete(made.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (made.id, "file", True)
    for reach in (alice.files.retrieve, alice.files.content, alice.files.delete):
        with pytest.raises(openai.NotFoundError):
            await reach(made.id)
    assert [f async for f in alice.files.list()] == []
    assert stored_bytes(tmp_path / "files") == [tmp_path / "files" / "files" / theirs.id]
    [record, _] = await rows(queen)
    assert record.deleted_at is not None  # the row stays, marked


@pytest.mark.parametrize(("examples", "replace", "says"), [
    (12, {7: b'{"messages": [{"role": "user", "content": "hi"}]}'},
     "line 7: no assistant message"),
    (12, {3: b"not json at all"}, "line 3: not valid JSON"),
    (9, {}, "The file has 9 examples; a training file needs at least 10"),
], ids=["no-assistant", "not-json", "too-few"])
async def test_a_bad_file_is_refused_naming_the_line_and_nothing_is_stored(
        queen, tmp_path, examples, replace, says):
    client = queen.client(api_key=await key(queen, "dev"))
    with pytest.raises(openai.BadRequestError) as caught:
        await client.files.create(file=("bad.jsonl", training_file(examples, replace=replace)),
                                  purpose="fine-tune")
    error = caught.value.body
    assert error["message"].startswith(says), error
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error", "file", "invalid_file_format")
    assert await rows(queen) == []
    assert stored_bytes(tmp_path / "files") == []
    assert [f async for f in client.files.list()] == []


async def test_another_purpose_is_refused_by_name(queen, tmp_path):
    client = queen.client(api_key=await key(queen, "dev"))
    with pytest.raises(openai.BadRequestError) as caught:
        await client.files.create(file=("a.jsonl", GOOD), purpose="assistants")
    assert caught.value.body["param"] == "purpose"
    assert "only for fine-tuning" in caught.value.body["message"]
    assert await rows(queen) == []
    assert stored_bytes(tmp_path / "files") == []


async def test_the_list_pages_as_the_sdk_reads_it(queen):
    client = queen.client(api_key=await key(queen, "dev"))
    made = [(await client.files.create(file=(f"{n}.jsonl", GOOD), purpose="fine-tune")).id
            for n in range(3)]
    page = await client.files.list(limit=2)
    assert [f.id for f in page.data] == made[:0:-1]  # newest first
    assert page.has_more
    assert page.last_id == made[1]
    assert page.first_id == made[2]
    assert [f.id async for f in client.files.list(limit=1)] == made[::-1]  # pages 1 by 1
    assert [f.id async for f in client.files.list(limit=2, order="asc")] == made
    after = await client.files.list(after=made[1], order="asc")
    assert [f.id for f in after.data] == [made[2]]
    assert after.has_more is False
    await client.files.delete(made[1])  # a deleted cursor keeps its place
    assert [f.id for f in (await client.files.list(after=made[1])).data] == [made[0]]
    assert (await client.files.list(purpose="batch")).data == []
    assert len((await client.files.list(purpose="fine-tune")).data) == 2
    with pytest.raises(openai.BadRequestError) as caught:
        await client.files.list(limit=0)
    assert caught.value.body["param"] == "limit"
    with pytest.raises(openai.BadRequestError) as caught:
        await client.files.list(after="file-nobodys")
    assert caught.value.body["param"] == "after"


async def test_the_upload_form_is_checked_field_by_field(queen):
    secret = await key(queen, "dev")
    auth = {"Authorization": f"Bearer {secret}"}
    good = {"file": ("t.jsonl", GOOD)}
    cases = [
        ({"files": good, "data": {}}, "purpose", "missing_required_parameter"),
        ({"files": {"file": (None, "text, not a file"), "purpose": (None, "fine-tune")}},
         "file", "invalid_value"),
        ({"files": good, "data": {"purpose": "fine-tune", "colour": "blue"}}, "colour",
         "unknown_parameter"),
        ({"files": good, "data": {"purpose": "fine-tune",
                                  "expires_after[anchor]": "created_at",
                                  "expires_after[seconds]": "3600"}}, "expires_after",
         "unsupported_parameter"),
        ({"files": {"file": ("x" * 300, GOOD)}, "data": {"purpose": "fine-tune"}}, "file",
         "invalid_filename"),
        ({"json": {"purpose": "fine-tune"}}, "file", "invalid_content_type"),
    ]
    async with httpx.AsyncClient(base_url=queen.base_url, trust_env=False) as http:
        for request, param, code in cases:
            answer = await http.post("/v1/files", headers=auth, **request)
            assert answer.status_code == 400, (request, answer.text)
            error = answer.json()["error"]
            assert (error["param"], error["code"]) == (param, code), error
        boundaryless = await http.post("/v1/files", headers={
            **auth, "Content-Type": "multipart/form-data"}, content=b"--x\r\n")
        assert boundaryless.status_code == 400
        assert boundaryless.json()["error"]["code"] == "invalid_multipart"
        anonymous = await http.post("/v1/files", files=good, data={"purpose": "fine-tune"})
        assert anonymous.status_code == 401
    assert await rows(queen) == []


async def test_a_file_over_the_limit_is_refused_while_it_streams_in(tmp_path, db_url):
    limit = 4096
    async with running_queen(tmp_path, auth="keys", db=db_url, files_dir=tmp_path / "files",
                             files_max_bytes=limit) as queen:
        client = queen.client(api_key=await key(queen, "dev"))
        with pytest.raises(openai.APIStatusError) as caught:  # a little over: the file part
            await client.files.create(file=("big.jsonl", training_file(60)), purpose="fine-tune")
        assert caught.value.status_code == 413
        assert caught.value.body["code"] == "file_too_large"
        assert caught.value.body["param"] == "file"

        status, sent = await endless_upload(queen, client.api_key)
        assert status == 413
        assert sent < ENDLESS_BYTES // 4  # answered long before the client was done
        assert await rows(queen) == []
        assert stored_bytes(tmp_path / "files") == []


ENDLESS_BYTES = 256 << 20


async def endless_upload(queen: QueenHarness, secret: str) -> tuple[int, int]:
    """A client that streams a file part with no Content-Length (chunked) and would go on for
    256 MiB: only counting the stream can stop it. Sends until the queen answers; returns the
    answer's status and the bytes sent by then."""
    reader, writer = await asyncio.open_connection("127.0.0.1", queen.port)
    writer.write(b"POST /v1/files HTTP/1.1\r\nHost: queen\r\nTransfer-Encoding: chunked\r\n"
                 b"Authorization: Bearer " + secret.encode() + b"\r\n"
                 b"Content-Type: multipart/form-data; boundary=b\r\n\r\n")
    head = b'--b\r\nContent-Disposition: form-data; name="file"; filename="x"\r\n\r\n'
    chunk = b"x" * (64 << 10)
    sent = 0

    async def send() -> None:
        nonlocal sent
        writer.write(b"%x\r\n%s\r\n" % (len(head), head))
        while sent < ENDLESS_BYTES:
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
            await writer.drain()

    sending = asyncio.create_task(send())
    try:
        async with asyncio.timeout(30):
            status_line = await reader.readline()
    finally:
        sending.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await sending
        writer.close()
    return int(status_line.split()[1]), sent


async def test_on_an_open_queen_keyless_callers_share_the_open_callers_files(tmp_path):
    async with running_queen(tmp_path, auth="open", api_keys=["dev-key"],
                             files_dir=tmp_path / "files") as queen:
        anyone = queen.client(api_key="not-a-key")  # unknown keys are served as the open caller
        someone = queen.client(api_key="another-unknown")
        dev = queen.client(api_key="dev-key")
        shared = await anyone.files.create(file=("o.jsonl", GOOD), purpose="fine-tune")
        assert (await someone.files.retrieve(shared.id)).id == shared.id
        own = await dev.files.create(file=("d.jsonl", GOOD), purpose="fine-tune")
        assert [f.id async for f in dev.files.list()] == [own.id]  # a key keeps its own
        with pytest.raises(openai.NotFoundError):
            await anyone.files.retrieve(own.id)
        dev_owner = "dev:" + hashlib.sha256(b"dev-key").hexdigest()
        assert {row.owner for row in await rows(queen)} == {"open", dev_owner}


async def test_storage_that_fails_refuses_the_upload_and_records_nothing(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the folder should be")
    async with running_queen(tmp_path, auth="open", files_dir=blocker) as queen:
        client = queen.client()
        with pytest.raises(openai.APIStatusError) as caught:
            await client.files.create(file=("t.jsonl", GOOD), purpose="fine-tune")
        assert caught.value.status_code == 503
        assert caught.value.body["code"] == "file_storage_unavailable"
        assert await rows(queen) == []


async def test_a_record_that_fails_takes_its_bytes_back_out(tmp_path):
    async with running_queen(tmp_path, auth="open", files_dir=tmp_path / "files") as queen:
        assert queen.state.db is not None
        async with queen.state.db.engine.begin() as conn:  # the database loses the table
            await conn.execute(text("DROP TABLE files"))
        with pytest.raises(openai.APIStatusError) as caught:
            await queen.client().files.create(file=("t.jsonl", GOOD), purpose="fine-tune")
        assert caught.value.status_code == 503
        assert stored_bytes(tmp_path / "files") == []  # the bytes written first are gone

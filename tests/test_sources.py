"""Tests of loramux.sources against real HTTP(S) servers on loopback addresses (no network, no llama.cpp).

https tests trust a throwaway CA made with the openssl command line tool (they skip without it).
"""

from __future__ import annotations

import base64
import errno
import hashlib
import logging
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from http_fixture import Request, Server, make_tls

import loramux.sources
from loramux.errors import (
    ChecksumError,
    DownloadCancelled,
    DownloadError,
    DownloadRefused,
    ParameterError,
    SourceError,
)
from loramux.sources import CancelToken, Source, guard, pull, resolve, tqdm_progress, url_cache_path

SIZE = 300 * 1024
FAST = {"retries": 2, "backoff": 0.01, "backoff_max": 0.02, "timeout": 2.0}


def fake_gguf(size: int = SIZE, seed: int = 0) -> bytes:
    return b"GGUF" + hashlib.shake_256(seed.to_bytes(4, "little")).digest(size - 4)


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A proxy from the environment would route 127.0.0.1 traffic away; caches must not leak between tests.
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy",
                "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LORAMUX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@pytest.fixture
def server() -> Server:
    srv = Server()
    yield srv
    srv.stop()


@pytest.fixture
def server2() -> Server:
    srv = Server()
    yield srv
    srv.stop()


@pytest.fixture
def other_name(server: Server) -> Server:
    """A second server at 127.0.0.2 on the first one's port: only the host name tells the two apart."""
    try:
        srv = Server(host="127.0.0.2", port=server.port)
    except OSError as exc:
        if exc.errno == errno.EADDRNOTAVAIL:
            pytest.skip("127.0.0.2 is not a loopback address on this system (the localhost case still runs)")
        srv = Server(host="127.0.0.2")  # that port is taken there: the name still differs
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[ssl.SSLContext, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command line tool to make a test certificate")
    return make_tls(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def tls_server(tls_files: tuple[ssl.SSLContext, Path], monkeypatch: pytest.MonkeyPatch) -> Server:
    """A server answering https and http on one port; the client trusts its test CA through SSL_CERT_FILE."""
    context, ca = tls_files
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))
    srv = Server(tls=context)
    yield srv
    srv.stop()


def gets(server: Server, path: str) -> list:
    return [r for r in server.for_path(path) if r.method == "GET"]


TOKEN, API_KEY, COOKIE, PASSWORD = "tok-s3cr3t", "key-s3cr3t", "cookie-s3cr3t", "pw-s3cr3t"
BASIC = base64.b64encode(f"user:{PASSWORD}".encode()).decode()  # how httpx sends URL userinfo
CREDENTIAL_HEADERS = {"authorization", "proxy-authorization", "cookie", "x-api-key"}


def leaked(request: Request) -> list[str]:
    """Credential headers of a recorded request, and any header whose value holds one of the secrets."""
    secrets = (TOKEN, API_KEY, COOKIE, PASSWORD, BASIC)
    return [f"{k}: {v}" for k, v in request.headers.items()
            if k.lower() in CREDENTIAL_HEADERS or any(secret in v for secret in secrets)]


def with_credentials(url: str, how: str) -> tuple[str, dict]:
    """The source URL and resolve() options carrying credentials ``how``: as options, or as URL userinfo."""
    if how == "userinfo":
        return url.replace("://", f"://user:{PASSWORD}@", 1), {}
    return url, {"token": TOKEN, "headers": {"X-Api-Key": API_KEY, "Cookie": f"c={COOKIE}"}}


# ------------------------------------------------------------------------------------------ Source.parse


def test_parse_paths(tmp_path: Path) -> None:
    assert Source.parse("adapters/x.gguf") == Source(kind="path", text="adapters/x.gguf", path=Path("adapters/x.gguf"))
    assert Source.parse("/abs/x.gguf").path == Path("/abs/x.gguf")
    assert Source.parse("~/x.gguf").path == Path.home() / "x.gguf"
    assert Source.parse("file:///abs/my%20x.gguf").path == Path("/abs/my x.gguf")
    assert Source.parse("file://localhost/abs/x.gguf").path == Path("/abs/x.gguf")
    assert Source.parse(tmp_path / "x.gguf").path == tmp_path / "x.gguf"


def test_parse_urls() -> None:
    src = Source.parse("https://example.org/a/b.gguf?x=1")
    assert (src.kind, src.url, src.sha256) == ("url", "https://example.org/a/b.gguf?x=1", None)
    pin = "AB" * 32
    src = Source.parse(f"http://example.org:8080/b.gguf#sha256={pin}")
    assert (src.url, src.sha256) == ("http://example.org:8080/b.gguf", pin.lower())
    assert Source.parse("https://example.org/b.gguf#section").sha256 is None


def test_parse_hf() -> None:
    src = Source.parse("hf://owner/repo/sub/dir/file.gguf")
    assert (src.kind, src.repo_id, src.filename, src.revision) == ("hf", "owner/repo", "sub/dir/file.gguf", None)
    src = Source.parse("hf://owner/repo/file.gguf@v1.0")
    assert (src.repo_id, src.filename, src.revision) == ("owner/repo", "file.gguf", "v1.0")
    commit = "0123456789abcdef0123456789abcdef01234567"
    assert Source.parse(f"hf://owner/repo/a/b.gguf@{commit}").revision == commit
    src = Source.parse("hf://datasets/owner/repo/f.gguf")
    assert (src.repo_type, src.repo_id, str(src)) == ("dataset", "owner/repo", "hf://datasets/owner/repo/f.gguf")
    assert str(Source.parse("hf://owner/repo/file.gguf@v1.0")) == "hf://owner/repo/file.gguf@v1.0"


@pytest.mark.parametrize("text", ["s3://bucket/x.gguf", "ftp://host/x.gguf", "hf://owner", "hf://owner/repo",
                                  "hf://owner/repo/", "hf://owner/repo/x.gguf@", "hf://owner/../x.gguf",
                                  "", "   ", "https:///nohost.gguf", "https://h/x.gguf#sha256=abc",
                                  "file://otherhost/x.gguf"])
def test_parse_bad_forms(text: str) -> None:
    with pytest.raises(SourceError) as info:
        Source.parse(text)
    assert "hf://" in str(info.value) or "sha256" in str(info.value) or "file://" in str(info.value)


def test_parse_unknown_scheme_lists_forms() -> None:
    with pytest.raises(SourceError, match=r"unsupported source scheme s3://(.|\n)*hf://owner/repo"):
        Source.parse("s3://bucket/x.gguf")


# ------------------------------------------------------------------------------------------ local paths


def test_local_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a.gguf").write_bytes(b"GGUF....")
    monkeypatch.chdir(tmp_path)
    assert resolve("a.gguf") == tmp_path / "a.gguf"
    assert resolve(f"file://{tmp_path}/a.gguf") == tmp_path / "a.gguf"
    with pytest.raises(ChecksumError):
        resolve("a.gguf", sha256="0" * 64)


def test_missing_local_file(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="no such file") as info:
        resolve(tmp_path / "missing.gguf")
    assert str(tmp_path / "missing.gguf") in str(info.value)
    assert "check the path" in str(info.value)
    with pytest.raises(SourceError, match="not a regular file"):
        resolve(tmp_path)


def test_bad_option() -> None:
    with pytest.raises(ValueError, match="policy"):
        resolve("x.gguf", policy="sometimes")


# ------------------------------------------------------------------------------------------ URLs


def test_full_download(server: Server, tmp_path: Path) -> None:
    data = fake_gguf()
    server.add("/a/adapter.gguf", data)
    seen: list[tuple[int, int | None]] = []
    path = resolve(server.url("/a/adapter.gguf"), progress=lambda r, t: seen.append((r, t)))
    assert path.read_bytes() == data
    assert path == url_cache_path(server.url("/a/adapter.gguf"))
    assert path.parent == tmp_path / "cache" / "downloads" and path.name.endswith("-adapter.gguf")
    assert not path.with_name(path.name + ".partial").exists()
    assert seen[-1] == (SIZE, SIZE)
    assert server.sent("/a/adapter.gguf") == SIZE
    assert pull(server.url("/a/adapter.gguf")) == path  # cached: no second request
    assert len(gets(server, "/a/adapter.gguf")) == 1


def test_cache_name_ignores_credentials_and_fragment() -> None:
    assert url_cache_path("https://u:p@h.org/x.gguf#sha256=" + "0" * 64) == url_cache_path("https://h.org/x.gguf")
    assert url_cache_path("https://h.org/x.gguf?v=1") != url_cache_path("https://h.org/x.gguf?v=2")


def test_resume_after_cut(server: Server) -> None:
    data = fake_gguf()
    server.add("/cut.gguf", data, cut_once_at=SIZE // 2)
    path = resolve(server.url("/cut.gguf"), **FAST)
    assert path.read_bytes() == data
    reqs = gets(server, "/cut.gguf")
    assert len(reqs) == 2
    assert reqs[1].headers["Range"] == f"bytes={SIZE // 2}-"
    assert reqs[1].headers["If-Range"] == server.blobs["/cut.gguf"].current_etag()
    assert reqs[1].status == 206
    assert server.sent("/cut.gguf") < 1.5 * SIZE


def test_resume_restarts_when_file_changed(server: Server) -> None:
    old, new = fake_gguf(seed=1), fake_gguf(seed=2)
    blob = server.add("/chg.gguf", old, cut_once_at=SIZE // 3)
    with pytest.raises(DownloadError):
        resolve(server.url("/chg.gguf"), retries=0)
    blob.data = new  # new ETag: If-Range fails, the server sends the whole new file
    path = resolve(server.url("/chg.gguf"), **FAST)
    assert path.read_bytes() == new
    assert gets(server, "/chg.gguf")[-1].status == 200


def test_resume_answered_with_200_restarts(server: Server) -> None:
    data = fake_gguf()
    server.add("/norange.gguf", data, cut_once_at=SIZE // 2, ranges=False)
    seen: list[int] = []
    assert resolve(server.url("/norange.gguf"), progress=lambda r, t: seen.append(r), **FAST).read_bytes() == data
    reqs = gets(server, "/norange.gguf")
    assert "Range" in reqs[1].headers and reqs[1].status == 200
    assert 0 in seen[1:]  # progress went back to zero for the restart


def test_404_is_final(server: Server) -> None:
    with pytest.raises(DownloadError) as info:
        resolve(server.url("/nope.gguf"), **FAST)
    assert info.value.status == 404
    assert len(gets(server, "/nope.gguf")) == 1


def test_500_then_200(server: Server) -> None:
    data = fake_gguf()
    server.add("/flaky.gguf", data, fail_times=2)
    assert resolve(server.url("/flaky.gguf"), **FAST).read_bytes() == data
    assert [r.status for r in gets(server, "/flaky.gguf")] == [500, 500, 200]


def test_500_forever(server: Server) -> None:
    server.add("/down.gguf", fake_gguf(), fail_times=100)
    with pytest.raises(DownloadError, match="gave up after 3 attempts") as info:
        resolve(server.url("/down.gguf"), **FAST)
    assert info.value.status == 500


def test_slow_server_times_out(server: Server) -> None:
    server.add("/slow.gguf", fake_gguf(), slow=3.0)
    with pytest.raises(DownloadError, match="timed out"):
        resolve(server.url("/slow.gguf"), **{**FAST, "timeout": 0.2, "retries": 1})
    assert len(gets(server, "/slow.gguf")) == 2


def test_html_instead_of_gguf(server: Server) -> None:
    server.add("/page.gguf", b"", html=True)
    with pytest.raises(DownloadError, match=r"HTML page, not a GGUF file"):
        resolve(server.url("/page.gguf"), **FAST)
    final = url_cache_path(server.url("/page.gguf"))
    assert not final.exists() and not final.with_name(final.name + ".partial").exists()
    assert len(gets(server, "/page.gguf")) == 1  # wrong content is not retried
    assert resolve(server.url("/page.gguf"), expect_gguf=False).read_bytes().startswith(b"<!DOCTYPE")


def test_truncated_body(server: Server) -> None:
    server.add("/trunc.gguf", fake_gguf(), truncate_at=1000)
    with pytest.raises(DownloadError, match="truncated"):
        resolve(server.url("/trunc.gguf"), **FAST)
    final = url_cache_path(server.url("/trunc.gguf"))
    assert not final.exists()
    assert final.with_name(final.name + ".partial").stat().st_size == 1000  # kept for a resume
    assert len(gets(server, "/trunc.gguf")) == 1 + FAST["retries"]


def test_sha256_mismatch_publishes_nothing(server: Server) -> None:
    server.add("/pin.gguf", fake_gguf())
    with pytest.raises(ChecksumError) as info:
        resolve(server.url("/pin.gguf"), sha256="0" * 64)
    assert info.value.expected == "0" * 64
    final = url_cache_path(server.url("/pin.gguf"))
    assert not final.exists() and not final.with_name(final.name + ".partial").exists()


def test_sha256_fragment_pin(server: Server) -> None:
    data = fake_gguf()
    server.add("/frag.gguf", data)
    good = hashlib.sha256(data).hexdigest()
    assert resolve(server.url(f"/frag.gguf#sha256={good}")).read_bytes() == data
    with pytest.raises(ChecksumError):
        resolve(server.url("/frag.gguf#sha256=" + "1" * 64))
    with pytest.raises(SourceError, match="disagree"):
        resolve(server.url(f"/frag.gguf#sha256={good}"), sha256="1" * 64)


def test_two_concurrent_pulls(server: Server) -> None:
    data = fake_gguf()
    server.add("/both.gguf", data, chunk_delay=0.01)
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(resolve(server.url("/both.gguf"), **FAST))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors
    assert len(results) == 2 and results[0] == results[1] and results[0].read_bytes() == data
    assert len(gets(server, "/both.gguf")) == 1 and server.sent("/both.gguf") == SIZE
    assert [p.name for p in results[0].parent.iterdir() if ".partial" in p.name] == []


def test_concurrent_pull_from_another_process(server: Server) -> None:
    data = fake_gguf()
    server.add("/proc.gguf", data, chunk_delay=0.03)
    url = server.url("/proc.gguf")
    env = {**os.environ, "PYTHONPATH": str(Path(loramux.sources.__file__).parents[2])}
    code = "import sys; from loramux.sources import resolve; print(resolve(sys.argv[1]))"
    proc = subprocess.Popen([sys.executable, "-c", code, url], env=env, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 10
    while not gets(server, "/proc.gguf") and time.monotonic() < deadline:
        time.sleep(0.01)
    mine = resolve(url, **FAST)  # waits on the other process's lock, then reuses its file
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0 and Path(out.strip()) == mine and mine.read_bytes() == data
    assert len(gets(server, "/proc.gguf")) == 1


def test_cancel_then_resume(server: Server) -> None:
    data = fake_gguf()
    server.add("/cancel.gguf", data)
    token = CancelToken()

    def progress(received: int, total: int | None) -> None:
        if received >= SIZE // 3:
            token.cancel()

    with pytest.raises(DownloadCancelled) as info:
        resolve(server.url("/cancel.gguf"), cancel=token, progress=progress, **FAST)
    final = url_cache_path(server.url("/cancel.gguf"))
    partial = final.with_name(final.name + ".partial")
    assert not final.exists()
    assert SIZE // 3 <= partial.stat().st_size == info.value.received < SIZE
    kept = partial.stat().st_size
    assert resolve(server.url("/cancel.gguf"), cancel=CancelToken(), **FAST).read_bytes() == data
    assert gets(server, "/cancel.gguf")[-1].headers["Range"] == f"bytes={kept}-"


def test_cancel_before_start(server: Server) -> None:
    server.add("/c0.gguf", fake_gguf(), fail_times=5)
    token = CancelToken()
    token.cancel()
    with pytest.raises(DownloadCancelled):
        resolve(server.url("/c0.gguf"), cancel=token, **FAST)


def test_redirect_to_other_host_drops_credentials(server: Server, server2: Server) -> None:
    data = fake_gguf()
    server2.add("/real.gguf", data)
    server.add("/go.gguf", redirect=server2.url("/real.gguf"))
    path = resolve(server.url("/go.gguf"), token="secret", headers={"X-Api-Key": "k", "Cookie": "c=1"})
    assert path.read_bytes() == data
    first = gets(server, "/go.gguf")[0].headers
    assert first["Authorization"] == "Bearer secret" and first["X-Api-Key"] == "k"
    other = {k.lower() for k in gets(server2, "/real.gguf")[0].headers}
    assert not other & {"authorization", "x-api-key", "cookie"}


def test_same_host_redirect_keeps_credentials(server: Server) -> None:
    server.add("/real.gguf", fake_gguf())
    server.add("/moved.gguf", redirect="/real.gguf")
    resolve(server.url("/moved.gguf"), token="secret")
    assert gets(server, "/real.gguf")[0].headers["Authorization"] == "Bearer secret"


@pytest.mark.parametrize("how", ["options", "userinfo"])
@pytest.mark.parametrize("target", ["127.0.0.2", "localhost"])
def test_redirect_to_another_host_name_drops_credentials(request: pytest.FixtureRequest, server: Server,
                                                         target: str, how: str) -> None:
    # Same scheme and port, another host name: 127.0.0.2 is another server, localhost is this very one.
    dest = request.getfixturevalue("other_name") if target == "127.0.0.2" else server
    data = fake_gguf()
    dest.add("/real.gguf", data)
    server.add("/go.gguf", redirect=dest.url("/real.gguf", host=target))
    source, options = with_credentials(server.url("/go.gguf"), how)
    assert resolve(source, **options).read_bytes() == data
    first = gets(server, "/go.gguf")[0]
    assert first.header("Authorization") == (f"Basic {BASIC}" if how == "userinfo" else f"Bearer {TOKEN}")
    assert how == "userinfo" or first.header("X-Api-Key") == API_KEY
    (other,) = gets(dest, "/real.gguf")
    assert other.header("Host") == f"{target}:{server.port}"  # the redirect went where the test meant
    assert leaked(other) == []


@pytest.mark.parametrize("how", ["options", "userinfo"])
def test_https_to_http_downgrade_drops_credentials(tls_server: Server, how: str) -> None:
    # One server speaks https and http on one port, so the last redirect changes the scheme and nothing else.
    # The hop before it stays on the https origin and keeps the credentials. The redirect that downgrades
    # sets a (non-Secure) cookie, which a cookie jar would send on to http on the same host.
    data = fake_gguf()
    tls_server.add("/real.gguf", data)
    tls_server.add("/go.gguf", redirect=tls_server.url("/real.gguf", scheme="http"),
                   headers={"Set-Cookie": f"session={COOKIE}; Path=/"})
    tls_server.add("/start.gguf", redirect="/go.gguf")
    source, options = with_credentials(tls_server.url("/start.gguf", scheme="https"), how)
    assert resolve(source, **options).read_bytes() == data
    expected = f"Basic {BASIC}" if how == "userinfo" else f"Bearer {TOKEN}"
    for path in ("/start.gguf", "/go.gguf"):
        (hop,) = gets(tls_server, path)
        assert hop.scheme == "https" and hop.header("Authorization") == expected
    (plain,) = gets(tls_server, "/real.gguf")
    assert plain.scheme == "http"
    assert leaked(plain) == []


def test_redirect_loop(server: Server) -> None:
    server.add("/loop.gguf", redirect="/loop.gguf")
    with pytest.raises(DownloadError, match="redirects"):
        resolve(server.url("/loop.gguf"), **FAST)


def test_policy_use_revalidate_refresh(server: Server) -> None:
    old, new = fake_gguf(seed=1), fake_gguf(seed=2)
    blob = server.add("/pol.gguf", old)
    url = server.url("/pol.gguf")
    path = resolve(url)
    assert resolve(url, policy="use") == path and len(gets(server, "/pol.gguf")) == 1

    assert resolve(url, policy="revalidate").read_bytes() == old
    last = gets(server, "/pol.gguf")[-1]
    assert last.status == 304 and last.headers["If-None-Match"] == blob.current_etag()

    blob.data = new
    assert resolve(url, policy="use").read_bytes() == old  # "use" does not look
    assert resolve(url, policy="revalidate").read_bytes() == new
    assert gets(server, "/pol.gguf")[-1].status == 200

    before = server.sent("/pol.gguf")
    assert resolve(url, policy="refresh").read_bytes() == new
    assert server.sent("/pol.gguf") - before == SIZE


def test_cached_copy_with_other_pin_is_replaced(server: Server) -> None:
    old, new = fake_gguf(seed=1), fake_gguf(seed=2)
    blob = server.add("/re.gguf", old)
    resolve(server.url("/re.gguf"))
    blob.data = new
    pinned = resolve(server.url("/re.gguf"), sha256=hashlib.sha256(new).hexdigest())
    assert pinned.read_bytes() == new


def test_tqdm_progress(capsys: pytest.CaptureFixture[str]) -> None:
    bar = tqdm_progress("adapter.gguf", disable=False)
    for received in (0, 100, 200):
        bar(received, 200)
    bar(50, 200)  # a restart moves backwards
    bar.close()
    assert "adapter.gguf" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ hf://

COMMIT_MAIN = "a" * 40
COMMIT_V1 = "b" * 40


def hub_file(server: Server, revision: str, commit: str, data: bytes, name: str = "sub/adapter.gguf") -> None:
    etag = '"' + hashlib.sha256(data).hexdigest() + '"'
    server.add(f"/owner/repo/resolve/{revision}/{name}", data, etag=etag, headers={"X-Repo-Commit": commit})


@pytest.fixture
def hub(server: Server, monkeypatch: pytest.MonkeyPatch) -> Server:
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.port}")
    hub_file(server, "main", COMMIT_MAIN, fake_gguf(seed=10))
    hub_file(server, "v1.0", COMMIT_V1, fake_gguf(seed=11))
    return server


def test_hf_main_and_revision(hub: Server, tmp_path: Path) -> None:
    main = resolve("hf://owner/repo/sub/adapter.gguf")
    assert main.read_bytes() == fake_gguf(seed=10)
    assert str(main).startswith(str(tmp_path / "hf" / "hub"))
    assert COMMIT_MAIN in str(main)
    v1 = resolve("hf://owner/repo/sub/adapter.gguf@v1.0")
    assert v1.read_bytes() == fake_gguf(seed=11)
    assert len(gets(hub, "/owner/repo/resolve/main/sub/adapter.gguf")) == 1
    before = len(hub.requests)
    assert resolve("hf://owner/repo/sub/adapter.gguf") == main and len(hub.requests) == before  # cached: no network
    assert resolve("hf://owner/repo/sub/adapter.gguf", policy="revalidate") == main
    assert [r.method for r in hub.requests[before:] if "resolve" in r.path] == ["HEAD"]
    assert hub.for_path("/owner/repo/resolve/main/sub/adapter.gguf")[0].header("Authorization") is None


def test_hf_token_and_progress(hub: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_testtoken")
    seen: list[tuple[int, int | None]] = []
    resolve("hf://owner/repo/sub/adapter.gguf", progress=lambda r, t: seen.append((r, t)))
    reqs = hub.for_path("/owner/repo/resolve/main/sub/adapter.gguf")
    assert reqs and all(r.header("Authorization") == "Bearer hf_testtoken" for r in reqs)
    assert seen[-1] == (SIZE, SIZE)


def test_hf_cancel(hub: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    token = CancelToken()
    with pytest.raises(DownloadCancelled):
        resolve("hf://owner/repo/sub/adapter.gguf", cancel=token, progress=lambda r, t: token.cancel())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SourceError, match="not in the Hugging Face cache"):  # nothing was published
        resolve("hf://owner/repo/sub/adapter.gguf")


def test_hf_offline(hub: Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    warm = resolve("hf://owner/repo/sub/adapter.gguf")
    hub.stop()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve("hf://owner/repo/sub/adapter.gguf") == warm
    monkeypatch.setenv("HF_HOME", str(tmp_path / "cold"))
    with pytest.raises(SourceError, match="HF_HUB_OFFLINE") as info:
        resolve("hf://owner/repo/sub/adapter.gguf")
    assert not isinstance(info.value, DownloadError)


def test_hf_not_found(hub: Server) -> None:
    hub.add("/owner/repo/resolve/main/missing.gguf", status=404,
            headers={"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT_MAIN})
    with pytest.raises(DownloadError, match="not found in the repo") as info:
        resolve("hf://owner/repo/missing.gguf")
    assert info.value.status == 404


def test_hf_not_gguf(hub: Server) -> None:
    hub_file(hub, "main", COMMIT_MAIN, b'{"adapter": "config"}', name="adapter_config.json")
    with pytest.raises(DownloadError, match="the repo file is JSON, not a GGUF file"):
        resolve("hf://owner/repo/adapter_config.json")
    assert resolve("hf://owner/repo/adapter_config.json", expect_gguf=False).read_bytes().startswith(b"{")


def test_hf_pin(hub: Server) -> None:
    with pytest.raises(ChecksumError):
        resolve("hf://owner/repo/sub/adapter.gguf", sha256="2" * 64)
    good = hashlib.sha256(fake_gguf(seed=10)).hexdigest()
    assert resolve("hf://owner/repo/sub/adapter.gguf", sha256=good).is_file()


def test_hf_cache_dir_from_env(hub: Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert str(resolve("hf://owner/repo/sub/adapter.gguf")).startswith(str(tmp_path / "elsewhere"))
    assert os.path.isdir(tmp_path / "elsewhere")


@pytest.mark.parametrize("how", ["HF_TOKEN", "token", "Authorization header"])
def test_hf_redirect_to_storage_drops_credentials(hub: Server, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    # A Hub answers /resolve/ for a large file with a 302 to a storage host (S3, a CDN) and puts the file's
    # metadata on the 302. The storage URL here names this same server as localhost: another host name.
    data = fake_gguf(seed=12)
    hub.add("/storage/blob", data)
    hub.add("/owner/repo/resolve/main/lfs.gguf", redirect=hub.url("/storage/blob?signature=1", host="localhost"),
            headers={"X-Repo-Commit": COMMIT_MAIN, "X-Linked-Size": str(len(data)),
                     "X-Linked-Etag": '"' + hashlib.sha256(data).hexdigest() + '"'})
    options: dict = {}
    if how == "HF_TOKEN":
        monkeypatch.setenv("HF_TOKEN", TOKEN)
    elif how == "token":
        options["token"] = TOKEN
    else:
        options["headers"] = {"Authorization": f"Bearer {TOKEN}"}
    assert resolve("hf://owner/repo/lfs.gguf", **options).read_bytes() == data
    metadata = hub.for_path("/owner/repo/resolve/main/lfs.gguf")
    assert metadata and all(r.header("Authorization") == f"Bearer {TOKEN}" for r in metadata)
    (blob,) = gets(hub, "/storage/blob")
    assert blob.header("Host") == f"localhost:{hub.port}"
    assert leaked(blob) == []


def test_hf_refuses_custom_credential_headers(hub: Server) -> None:
    # huggingface_hub forwards every custom header to the storage host a file redirects to: refuse, early.
    with pytest.raises(ParameterError, match="X-Api-Key") as info:
        resolve("hf://owner/repo/sub/adapter.gguf", headers={"X-Api-Key": API_KEY})
    assert "token=" in str(info.value)
    assert hub.requests == []
    path = resolve("hf://owner/repo/sub/adapter.gguf", headers={"Accept-Language": "en"})  # no credential: fine
    assert path.read_bytes() == fake_gguf(seed=10)


# ------------------------------------------------------------------------------------------ hostile sources
# Each test below names the finding it guards: hf:// names that walk the file system, downloads without a size
# cap, decoded bodies, long redirect chains, and remote loads that reach loopback, link-local and private hosts.

SECRET = "/TOPSECRET-3f1c"  # starts with '/': huggingface_hub's pointer-path check used to quote it back


@pytest.mark.parametrize("text", ["hf://own--er/repo/x.gguf", "hf://owner/re..po/x.gguf", "hf://-owner/repo/x.gguf",
                                  "hf://owner/repo.git/x.gguf", "hf://own er/repo/x.gguf",
                                  "hf://owner/" + "r" * 97 + "/x.gguf", "hf://datasets/own--er/repo/x.gguf"])
def test_hf_repo_id_validated_like_huggingface_hub(text: str) -> None:
    with pytest.raises(SourceError, match="repo id") as info:
        Source.parse(text)
    assert not isinstance(info.value, DownloadError)


@pytest.mark.parametrize("revision", ["../../../../secret.txt", "/etc/passwd", "refs/../../x", "main/..",
                                      "a/../../b", "..", "v1\x00"])
def test_hf_revision_that_walks_is_refused(revision: str) -> None:
    with pytest.raises(SourceError, match="revision"):
        Source.parse(f"hf://owner/repo/x.gguf@{revision}")


def test_hf_revision_forms_that_stay_valid() -> None:
    for revision in ("refs/pr/1", "main", "v1.0", "a" * 40, "feature/x..y", "release-1.2"):
        assert Source.parse(f"hf://owner/repo/x.gguf@{revision}").revision == revision


def test_hf_revision_walk_reads_and_echoes_nothing(hub: Server, tmp_path: Path) -> None:
    # The repo's cache folder exists (a first load), so a walk out of its refs/ folder would reach tmp_path.
    resolve("hf://owner/repo/sub/adapter.gguf")
    (tmp_path / "secret.txt").write_text(SECRET)
    walk = "hf://owner/repo/sub/adapter.gguf@../../../../secret.txt"
    with pytest.raises(SourceError) as info:
        resolve(walk)
    assert SECRET not in str(info.value) and "TOPSECRET" not in str(info.value)
    # A Source built by hand skips parse: the fetcher checks the revision itself before huggingface_hub runs.
    handmade = Source(kind="hf", text="x", repo_id="owner/repo", filename="sub/adapter.gguf",
                      revision="../../../../secret.txt")
    before = len(hub.requests)
    with pytest.raises(SourceError, match="revision") as info:
        resolve(handmade)
    assert "TOPSECRET" not in str(info.value) and len(hub.requests) == before


def test_hf_file_outside_the_hub_cache_is_refused(hub: Server, tmp_path: Path) -> None:
    # A cache entry that is a symlink out of the cache (planted, or a cache shared with another user) is refused.
    cached = resolve("hf://owner/repo/sub/adapter.gguf")
    outside = tmp_path / "outside.gguf"
    outside.write_bytes(fake_gguf(seed=99))
    cached.unlink()
    cached.symlink_to(outside)
    with pytest.raises(SourceError, match="outside the Hugging Face cache") as info:
        resolve("hf://owner/repo/sub/adapter.gguf")
    assert str(outside) not in str(info.value)


def test_hf_unexpected_failure_does_not_echo_its_text(hub: Server) -> None:
    # The Hub names a commit that is an absolute path: huggingface_hub refuses it with a ValueError quoting it.
    # Whatever an unexpected exception says (it may quote a file it read), the message names only its type.
    hub_file(hub, "main", SECRET, fake_gguf(seed=13), name="odd.gguf")
    with pytest.raises(DownloadError) as info:
        resolve("hf://owner/repo/odd.gguf")
    assert "TOPSECRET" not in str(info.value)


def test_not_gguf_message_quotes_no_bytes(server: Server) -> None:
    server.add("/text.gguf", b"TOPSECRET-3f1c and more of a private file")
    with pytest.raises(DownloadError, match="not a GGUF file") as info:
        resolve(server.url("/text.gguf"), **FAST)
    assert "TOPSECRET" not in str(info.value)


def test_size_cap_from_content_length(server: Server) -> None:
    server.add("/big.gguf", fake_gguf())
    seen: list[int] = []
    with pytest.raises(DownloadRefused, match="max_bytes") as info:
        resolve(server.url("/big.gguf"), max_bytes=SIZE - 1, progress=lambda r, t: seen.append(r), **FAST)
    assert info.value.reason == "too_large"
    assert max(seen, default=0) == 0  # refused on the announced length, before one body byte was stored
    final = url_cache_path(server.url("/big.gguf"))
    assert not final.exists() and not final.with_name(final.name + ".partial").exists()
    assert len(gets(server, "/big.gguf")) == 1  # a refusal is not retried
    assert resolve(server.url("/big.gguf"), max_bytes=SIZE).read_bytes() == fake_gguf()  # the cap is inclusive


def test_size_cap_while_streaming(server: Server) -> None:
    server.add("/chunked.gguf", fake_gguf(), chunked=True)  # no Content-Length to check up front
    seen: list[int] = []
    cap = 100 * 1024
    with pytest.raises(DownloadRefused, match="max_bytes") as info:
        resolve(server.url("/chunked.gguf"), max_bytes=cap, progress=lambda r, t: seen.append(r), **FAST)
    assert info.value.reason == "too_large" and max(seen) <= cap
    final = url_cache_path(server.url("/chunked.gguf"))
    assert not final.exists() and not final.with_name(final.name + ".partial").exists()
    assert resolve(server.url("/chunked.gguf"), **FAST).read_bytes() == fake_gguf()  # chunked itself is fine


def test_size_cap_of_a_cached_file(server: Server) -> None:
    server.add("/cached.gguf", fake_gguf())
    resolve(server.url("/cached.gguf"))
    with pytest.raises(DownloadRefused, match="max_bytes"):
        resolve(server.url("/cached.gguf"), max_bytes=1024)


def test_bad_max_bytes() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ParameterError, match="max_bytes"):
            resolve("x.gguf", max_bytes=bad)


def test_hf_size_cap_from_metadata(hub: Server) -> None:
    with pytest.raises(DownloadRefused, match="max_bytes") as info:
        resolve("hf://owner/repo/sub/adapter.gguf", max_bytes=SIZE - 1)
    assert info.value.reason == "too_large"
    assert gets(hub, "/owner/repo/resolve/main/sub/adapter.gguf") == []  # no download: the HEAD told the size
    assert resolve("hf://owner/repo/sub/adapter.gguf", max_bytes=SIZE).is_file()


def test_hf_size_cap_while_streaming(hub: Server, tmp_path: Path) -> None:
    # The metadata under-states the size (X-Linked-Size: 1000) and the storage host (another host name, so
    # huggingface_hub does not follow it for the metadata) sends the whole file.
    data = fake_gguf(seed=14)
    hub.add("/storage/liar", data)
    hub.add("/owner/repo/resolve/main/liar.gguf", redirect=hub.url("/storage/liar", host="localhost"),
            headers={"X-Repo-Commit": COMMIT_MAIN, "X-Linked-Size": "1000",
                     "X-Linked-Etag": '"' + hashlib.sha256(data).hexdigest() + '"'})
    cap = 64 * 1024
    with pytest.raises(DownloadRefused, match="max_bytes") as info:
        resolve("hf://owner/repo/liar.gguf", max_bytes=cap)
    assert info.value.reason == "too_large"
    assert gets(hub, "/storage/liar")  # the download did start: the stream itself was bounded
    assert max(f.stat().st_size for f in (tmp_path / "hf").rglob("*") if f.is_file()) <= cap


@pytest.fixture(scope="session")
def gzip_bomb() -> bytes:
    """A gzip body of about 1 MiB that decodes to 1 GiB of zeros (built in pieces: full flushes repeat)."""
    import zlib

    zeros, count = b"\0" * (1 << 20), 1024
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)  # raw deflate: the gzip header and trailer are written here
    first = comp.compress(zeros) + comp.flush(zlib.Z_FULL_FLUSH)
    block = comp.compress(zeros) + comp.flush(zlib.Z_FULL_FLUSH)  # the same bytes for every later MiB
    crc = 0
    for _ in range(count):
        crc = zlib.crc32(zeros, crc)
    body = first + block * (count - 1) + comp.flush(zlib.Z_FINISH)
    trailer = crc.to_bytes(4, "little") + (count << 20 & 0xFFFFFFFF).to_bytes(4, "little")
    return b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + body + trailer


def test_gzip_body_is_never_decoded(server: Server, gzip_bomb: bytes, tmp_path: Path) -> None:
    server.add("/bomb.gguf", gzip_bomb, headers={"Content-Encoding": "gzip"})
    seen: list[int] = []
    with pytest.raises(DownloadRefused, match="Content-Encoding") as info:
        resolve(server.url("/bomb.gguf"), headers={"Accept-Encoding": "gzip"}, progress=lambda r, t: seen.append(r),
                **FAST)
    assert info.value.reason == "content_encoding"
    assert max(seen, default=0) == 0
    assert [r.header("Accept-Encoding") for r in gets(server, "/bomb.gguf")] == ["identity"]  # even when asked
    written = sum(f.stat().st_size for f in (tmp_path / "cache").rglob("*") if f.is_file())
    assert written < len(gzip_bomb)


def test_redirect_limit(server: Server) -> None:
    assert loramux.sources.MAX_REDIRECTS == 5
    server.add("/hop0.gguf", fake_gguf())
    for i in range(1, 7):
        server.add(f"/hop{i}.gguf", redirect=f"/hop{i - 1}.gguf")
    assert resolve(server.url("/hop5.gguf"), **FAST).read_bytes() == fake_gguf()  # 5 redirects: fine
    with pytest.raises(DownloadRefused, match="more than 5 redirects") as info:
        resolve(server.url("/hop6.gguf"), **FAST)
    assert info.value.reason == "redirects"
    assert gets(server, "/hop0.gguf") and len(gets(server, "/hop6.gguf")) == 1


# ---------------------------------------------------------------- the private-network guard (no traffic leaves
# 127.0.0.0/8: refusals are checked with made-up names and addresses, and any connection attempt fails the test)


@pytest.fixture
def no_connect(monkeypatch: pytest.MonkeyPatch) -> list:
    """Record and refuse every outgoing TCP connection, so a guard that fails cannot send a packet anywhere."""
    attempts: list = []

    def refuse(address, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        attempts.append(address)
        raise AssertionError(f"a connection to {address} was attempted")

    monkeypatch.setattr(socket, "create_connection", refuse)
    return attempts


def fake_dns(monkeypatch: pytest.MonkeyPatch, names: dict[str, list[str]]) -> list[str]:
    """Answer getaddrinfo for made-up host names; real lookups for everything else. Returns the names asked."""
    real, asked = socket.getaddrinfo, []

    def getaddrinfo(host, port, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        if host in names:
            asked.append(host)
            answer = names[host]
            if callable(answer):
                answer = answer()
            return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                     (a, port, 0, 0) if ":" in a else (a, port)) for a in answer]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return asked


@pytest.mark.parametrize(("address", "kind"), [
    ("127.0.0.1", "loopback"), ("::1", "loopback"), ("169.254.169.254", "link-local"), ("fe80::1", "link-local"),
    ("10.0.0.1", "private"), ("172.16.5.4", "private"), ("192.168.1.1", "private"), ("fc00::1", "private"),
    ("fd12:3456::1", "private"), ("224.0.0.1", "multicast"), ("ff02::1", "multicast"), ("0.0.0.0", "unspecified"),
    ("::", "unspecified"), ("::ffff:127.0.0.1", "loopback"), ("::ffff:169.254.169.254", "link-local"),
    ("64:ff9b::a00:1", "private"), ("2002:a00:1::", "private"), ("100.64.0.1", "not public"),
    ("192.0.2.1", "private"), ("240.0.0.1", "private"), ("255.255.255.255", "private"),
    ("1.1.1.1", None), ("8.8.8.8", None), ("2606:4700:4700::1111", None),
])
def test_address_classification(address: str, kind: str | None) -> None:
    assert guard.refusal(address) == kind


@pytest.mark.parametrize("url", ["http://169.254.169.254/latest/meta-data/x.gguf", "http://10.0.0.1/x.gguf",
                                 "http://[fe80::1]/x.gguf", "http://[::ffff:127.0.0.1]:8080/x.gguf",
                                 "http://0.0.0.0/x.gguf", "http://224.0.0.1/x.gguf", "https://192.168.0.10/x.gguf",
                                 "http://127.0.0.1:9/x.gguf", "http://[fc00::1]/x.gguf"])
def test_private_address_refused_without_a_connection(no_connect: list, url: str) -> None:
    with pytest.raises(DownloadRefused, match="allow_private_networks") as info:
        resolve(url, allow_private_networks=False, **FAST)
    assert info.value.reason == "private_network" and no_connect == []


def test_name_resolving_to_a_private_address_is_refused(no_connect: list, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every address of the name is checked: one private address among public ones is enough to refuse.
    asked = fake_dns(monkeypatch, {"metadata.example.test": ["169.254.169.254"],
                                   "mixed.example.test": ["1.1.1.1", "10.0.0.1"]})
    for host in ("metadata.example.test", "mixed.example.test"):
        with pytest.raises(DownloadRefused, match=r"resolves to .*(169\.254|10\.0\.0\.1)") as info:
            resolve(f"https://user:pw@{host}/x.gguf?sig=1", allow_private_networks=False, **FAST)
        assert info.value.reason == "private_network" and "pw" not in str(info.value)
    assert asked == ["metadata.example.test", "mixed.example.test"] and no_connect == []


def test_library_default_allows_private_networks(server: Server) -> None:
    # resolve() on one's own machine reaches one's own servers; the server turns the guard on for remote loads.
    assert loramux.sources.SourceOptions().allow_private_networks is True
    server.add("/local.gguf", fake_gguf())
    assert resolve(server.url("/local.gguf")).read_bytes() == fake_gguf()
    with pytest.raises(DownloadRefused):
        resolve(server.url("/local.gguf"), allow_private_networks=False, policy="refresh")


@pytest.fixture
def loopback_is_public(monkeypatch: pytest.MonkeyPatch) -> None:
    """Treat 127.0.0.1 (and only it) as a public address: the stand-in for a public server, which tests cannot
    reach. Every other address keeps its real classification."""
    real = guard.refusal
    monkeypatch.setattr(guard, "refusal", lambda address: None if address == "127.0.0.1" else real(address))


def test_redirect_to_a_private_address_is_refused(loopback_is_public: None, server: Server,
                                                  other_name: Server) -> None:
    other_name.add("/inside.gguf", fake_gguf())
    server.add("/out.gguf", redirect=other_name.url("/inside.gguf"))  # "public" 127.0.0.1 -> "private" 127.0.0.2
    with pytest.raises(DownloadRefused, match="127.0.0.2") as info:
        resolve(server.url("/out.gguf"), allow_private_networks=False, **FAST)
    assert info.value.reason == "private_network"
    assert len(gets(server, "/out.gguf")) == 1 and other_name.requests == []


def test_connects_to_the_checked_address(loopback_is_public: None, server: Server, other_name: Server,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # DNS rebinding: the name answers a public address to the check and a private one to any later lookup.
    # The connection must go to the address that was checked, not to a second answer.
    answers = iter([["127.0.0.1"]])
    fake_dns(monkeypatch, {"rebind.example.test": lambda: next(answers, ["127.0.0.2"])})
    server.add("/r.gguf", fake_gguf(seed=1))
    other_name.add("/r.gguf", fake_gguf(seed=2))
    url = f"http://rebind.example.test:{server.port}/r.gguf"
    assert resolve(url, allow_private_networks=False, **FAST).read_bytes() == fake_gguf(seed=1)
    (req,) = gets(server, "/r.gguf")
    assert req.header("Host") == f"rebind.example.test:{server.port}" and other_name.requests == []


def test_guarded_https_checks_the_certificate_of_the_name(loopback_is_public: None, tls_server: Server,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # Connecting to a checked address keeps TLS about the name: SNI and certificate checks use the host name.
    fake_dns(monkeypatch, {"localhost": ["127.0.0.1"], "wrong.example.test": ["127.0.0.1"]})
    tls_server.add("/t.gguf", fake_gguf())
    url = tls_server.url("/t.gguf", host="localhost", scheme="https")
    assert resolve(url, allow_private_networks=False, **FAST).read_bytes() == fake_gguf()
    with pytest.raises(DownloadError, match="connection error"):  # the certificate does not name it
        resolve(tls_server.url("/t.gguf", host="wrong.example.test", scheme="https"), allow_private_networks=False,
                **{**FAST, "retries": 0})


def test_request_logs_show_urls_redacted(server: Server, caplog: pytest.LogCaptureFixture) -> None:
    # httpx logs each request's URL at INFO: a password or a signed query string must not reach the logs.
    server.add("/logged.gguf", fake_gguf())
    caplog.set_level(logging.DEBUG)
    url = server.url("/logged.gguf").replace("://", f"://user:{PASSWORD}@", 1) + "?X-Amz-Signature=sig-s3cr3t"
    resolve(url, **FAST)
    assert "logged.gguf" in caplog.text  # the request was logged ...
    assert PASSWORD not in caplog.text and "sig-s3cr3t" not in caplog.text  # ... without its secrets

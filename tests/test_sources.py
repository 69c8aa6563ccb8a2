"""Tests of loramux.sources against real HTTP(S) servers on loopback addresses (no network, no llama.cpp).

https tests trust a throwaway CA made with the openssl command line tool (they skip without it).
"""

from __future__ import annotations

import base64
import errno
import hashlib
import os
import shutil
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from http_fixture import Request, Server, make_tls

import loramux.sources
from loramux.errors import ChecksumError, DownloadCancelled, DownloadError, ParameterError, SourceError
from loramux.sources import CancelToken, Source, pull, resolve, tqdm_progress, url_cache_path

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
    with pytest.raises(DownloadError, match=r"HTML page, not a GGUF file \(got '<!DOCTYPE'"):
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

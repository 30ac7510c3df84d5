"""A real LNbits (the registry's ``lnbits``, with its FakeWallet funding source) on a free
loopback port, for the payout tests (issue 40): the queen pays through LNbits' own API, and a
worker's Lightning address hands out invoices of a wallet on the same LNbits, so the payment is
LNbits' own (internal) and LNbits shows it received.

LNbits pins its own versions of FastAPI, pydantic and friends, so it lives in a virtualenv of
its own, ``.venv-lnbits`` at the project's root (``APIARY_TEST_LNBITS_VENV`` elsewhere), made by

    python3 -m tests.support.lnbits_server install      # once; python3 dev.py test does it

The tests skip, saying that command, when it is missing. LNbits 1.6.2 imports
``bitstring.ConstBitStream``, which bitstring 5 removed: the install pins ``bitstring<5``.

``LnbitsServer`` starts it with a fixed super user, finishes its first-install step (an admin
login, whose token may credit a wallet), and makes wallets (``wallet``), credits them
(``credit``), reads their balance (``balance_msat``) and their payments (``payments``).
``LnbitsAddress`` is a worker's Lightning address whose invoices are that worker's LNbits
wallet's: ``FakeLnurlServer``'s LNURL-pay service with ``invoices_from=``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import time
import uuid
import venv
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.support.fake_lightning import FakeLnurlServer
from tests.support.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
LNBITS_VERSION = "1.6.2"
REQUIREMENTS = (f"lnbits=={LNBITS_VERSION}", "bitstring<5")
INSTALL_COMMAND = "python3 -m tests.support.lnbits_server install"
ADMIN_PASSWORD = "apiary-tests-admin"  # a throwaway LNbits of the tests


def venv_dir() -> Path:
    return Path(os.environ.get("APIARY_TEST_LNBITS_VENV", ROOT / ".venv-lnbits"))


def _stamp(folder: Path) -> Path:
    return folder / ".apiary-lnbits"


def installed() -> bool:
    """Whether LNbits is installed where the tests look, at the pinned version."""
    stamp = _stamp(venv_dir())
    return stamp.is_file() and stamp.read_text().strip() == " ".join(REQUIREMENTS)


def install() -> None:
    """Make ``.venv-lnbits`` with LNbits in it (a few minutes the first time; then nothing)."""
    folder = venv_dir()
    if installed():
        return
    venv.EnvBuilder(with_pip=True, clear=True).create(folder)
    subprocess.run([str(folder / "bin" / "python"), "-m", "pip", "install", "-q",
                    "--disable-pip-version-check", *REQUIREMENTS], check=True)
    _stamp(folder).write_text(" ".join(REQUIREMENTS))


def _site_packages(folder: Path) -> Path:
    found = subprocess.run(
        [str(folder / "bin" / "python"), "-c", "import lnbits, pathlib; "
         "print(pathlib.Path(lnbits.__file__).parent.parent)"],
        capture_output=True, text=True, check=True, cwd=folder)  # importing lnbits writes ./data
    return Path(found.stdout.strip())


@dataclass(frozen=True)
class Wallet:
    id: str
    admin_key: str
    invoice_key: str


class LnbitsServer:
    """LNbits with the FakeWallet funding source, its data in ``workdir``."""

    def __init__(self, workdir: Path) -> None:
        if not installed():
            raise RuntimeError(f"LNbits is not installed: {INSTALL_COMMAND}")
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.super_user = uuid.uuid4().hex
        self.popen: subprocess.Popen[bytes] | None = None
        self.token = ""
        self.http = httpx.Client(base_url=self.url, timeout=30, trust_env=False)

    def __enter__(self) -> LnbitsServer:
        data = self.workdir / "lnbits-data"
        data.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "LNBITS_DATA_FOLDER": str(data),
               "LNBITS_BACKEND_WALLET_CLASS": "FakeWallet", "SUPER_USER": self.super_user,
               "LNBITS_ADMIN_UI": "true", "AUTH_ALLOWED_METHODS": '["username-password"]',
               "LNBITS_EXTENSIONS_DEFAULT_INSTALL": "", "PYTHONUNBUFFERED": "1"}
        folder = venv_dir()
        log = (self.workdir / "lnbits.log").open("wb")
        # LNbits serves its static files from the relative folder lnbits/static.
        # Its own process group: the lnbits command runs the server in a child of its own,
        # which outlives a SIGTERM to the command alone.
        self.popen = subprocess.Popen(
            [str(folder / "bin" / "lnbits"), "--host", "127.0.0.1", "--port", str(self.port)],
            cwd=_site_packages(folder), env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
        log.close()
        try:
            self._wait_up(90)
            answer = self.http.put("/api/v1/auth/first_install", json={
                "username": "admin", "password": ADMIN_PASSWORD,
                "password_repeat": ADMIN_PASSWORD})
            answer.raise_for_status()
            self.token = answer.json()["access_token"]
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        if self.popen is not None:
            self._signal_group(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(20)
            self._signal_group(signal.SIGKILL)  # whatever of the group is left
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(10)
        self.http.close()

    def _signal_group(self, signum: int) -> None:
        assert self.popen is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signum)

    def log(self) -> str:
        path = self.workdir / "lnbits.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def _wait_up(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.popen is not None
            if self.popen.poll() is not None:
                raise RuntimeError(
                    f"LNbits exited ({self.popen.returncode}):\n{self.log()[-3000:]}")
            try:
                # Before its first-install step LNbits redirects every page there: it is up.
                if self.http.get("/api/v1/health").status_code in (200, 307):
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"LNbits did not start in {timeout_s} s:\n{self.log()[-3000:]}")

    # --- wallets ---------------------------------------------------------------------------

    def wallet(self, name: str) -> Wallet:
        answer = self.http.post("/api/v1/account", json={"name": name})
        answer.raise_for_status()
        body = answer.json()
        return Wallet(body["id"], body["adminkey"], body["inkey"])

    def credit(self, wallet: Wallet, sats: int) -> None:
        """The super user's credit, as LNbits' admin page gives it."""
        answer = self.http.put("/users/api/v1/balance", json={"id": wallet.id, "amount": sats},
                               headers={"Authorization": f"Bearer {self.token}"})
        answer.raise_for_status()

    def balance_msat(self, wallet: Wallet) -> int:
        answer = self.http.get("/api/v1/wallet", headers={"X-Api-Key": wallet.invoice_key})
        answer.raise_for_status()
        return int(answer.json()["balance"])

    def payments(self, wallet: Wallet) -> list[dict[str, Any]]:
        """The wallet's payments as LNbits lists them, newest first."""
        answer = self.http.get("/api/v1/payments", headers={"X-Api-Key": wallet.invoice_key})
        answer.raise_for_status()
        return list(answer.json())

    def invoice(self, wallet: Wallet, amount_msat: int, description_hash: str) -> dict[str, Any]:
        """An invoice of ``wallet`` through LNbits' own API (whole sats: LNbits' unit)."""
        if amount_msat % 1000:
            raise ValueError(f"LNbits invoices whole sats, not {amount_msat} msat")
        answer = self.http.post("/api/v1/payments", headers={"X-Api-Key": wallet.invoice_key},
                                json={"out": False, "amount": amount_msat // 1000,
                                      "memo": "Apiary payout",
                                      "description_hash": description_hash})
        answer.raise_for_status()
        return dict(answer.json())


class LnbitsAddress(FakeLnurlServer):
    """Lightning addresses (LUD-16) whose invoices are LNbits wallets' own: ``name`` pays into
    ``wallets[name]`` of ``lnbits``."""

    def __init__(self, lnbits: LnbitsServer, wallets: dict[str, Wallet]) -> None:
        super().__init__(tuple(wallets), invoices_from=self._lnbits_invoice)
        self.lnbits = lnbits
        self.wallets = wallets

    def _lnbits_invoice(self, name: str, amount_msat: int) -> tuple[str, str]:
        metadata_hash = hashlib.sha256(self.metadata(name).encode()).hexdigest()
        made = self.lnbits.invoice(self.wallets[name], amount_msat, metadata_hash)
        return made["bolt11"], made["payment_hash"]


if __name__ == "__main__":
    if sys.argv[1:] != ["install"]:
        sys.exit(f"usage: {INSTALL_COMMAND}")
    if not installed():
        sys.stdout.write(f"==> installing LNbits {LNBITS_VERSION} into {venv_dir()} for the "
                         "payout tests (first time: a few minutes)\n")
        sys.stdout.flush()
        install()

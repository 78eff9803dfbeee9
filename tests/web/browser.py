"""Headless Chromium for the web UI tests: Debian's ``chromium`` driven by Selenium through
Debian's ``chromium-driver`` (installed by ``make install``; no browser is downloaded).

The tests skip only where the packages are missing and ``apt-get`` cannot exist to
install them; on a Debian machine (CI) a missing browser is a failure.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1280,900")


def chromium_paths() -> tuple[str, str]:
    """(chromium, chromedriver) executables; skip or fail as the module docstring says."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if chromium and driver:
        return chromium, driver
    missing = "chromium" if not chromium else "chromedriver"
    if shutil.which("apt-get") is None:
        pytest.skip(f"{missing} is not installed and apt-get is unavailable to install "
                    "Debian's chromium and chromium-driver packages")
    pytest.fail(f"{missing} is not installed: `make install` installs Debian's chromium and "
                "chromium-driver (apt-get install -y chromium chromium-driver)")


def start_browser(profile_dir: Path) -> Any:
    """A headless Chromium with a fresh profile in ``profile_dir``."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver = chromium_paths()
    os.environ.setdefault("SE_OFFLINE", "true")   # Selenium Manager must not download
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile_dir}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    browser = webdriver.Chrome(service=Service(executable_path=driver), options=options)
    browser.set_page_load_timeout(30)
    browser.set_script_timeout(30)
    return browser


def wait_for(check: Callable[[], Any], timeout: float = 20.0, what: str = "condition",
             interval: float = 0.05) -> Any:
    """Poll ``check`` until it returns a truthy value (returned); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def open_page(browser: Any, url: str, *, clear_storage: bool = True) -> None:
    """Load ``url``; with ``clear_storage`` start from empty local and session storage."""
    browser.get_log("browser")   # start with an empty console log
    browser.get(url)
    if clear_storage:
        browser.execute_script("localStorage.clear(); sessionStorage.clear();")
        browser.get(url)


def console_errors(browser: Any) -> list[str]:
    """Severe browser console messages so far (CSP violations, script errors)."""
    return [e["message"] for e in browser.get_log("browser") if e.get("level") == "SEVERE"]


def save_screenshot(browser: Any, folder: Path, name: str) -> Path:
    """Write a PNG of the page to ``folder/name`` (and to $LLMSERVE_SCREENSHOT_DIR if set)."""
    path = folder / name
    browser.save_screenshot(str(path))
    extra = os.environ.get("LLMSERVE_SCREENSHOT_DIR")
    if extra:
        Path(extra).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, Path(extra) / name)
    return path


def server_status(url: str, **headers: str) -> dict[str, Any]:
    """A server's ``GET /v1/status`` body (``url``: its base URL)."""
    r = httpx.get(url + "/v1/status", headers=headers, timeout=10)
    r.raise_for_status()
    return r.json()

"""A headless Chromium (the Debian ``chromium`` package) driven by selenium through the system
``chromedriver``, for the playground page (edge/static/).

Nothing is downloaded at test time: the driver's path is given to selenium
(``Service(executable_path=...)``), so selenium-manager never runs. The
browser is also cut off from everything but loopback (a dead proxy and a host
resolver that resolves no name), as on a machine with no internet; every
request it makes is recorded in Chrome's performance log.

``make test`` installs the two packages (the ``browser-deps`` target); where
they cannot be installed the browser tests skip, saying so.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM_NAMES = ("chromium", "chromium-browser")
CHROMEDRIVER_NAME = "chromedriver"
WINDOW = (1280, 900)


def browser_paths() -> tuple[str, str] | None:
    """(chromium, chromedriver) from the PATH, or None when either is missing."""
    browser = next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)
    driver = shutil.which(CHROMEDRIVER_NAME)
    return (browser, driver) if browser and driver else None


@pytest.fixture(scope="session")
def chromium() -> tuple[str, str]:
    paths = browser_paths()
    if paths is None:
        pytest.skip(
            "chromium and chromedriver are not installed and could not be: `make test` installs them "
            "(apt-get install chromium chromium-driver, as root)"
        )
    return paths


@pytest.fixture(scope="module")
def browser(chromium: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One headless Chromium per test module; each test loads the page afresh."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = chromium
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for argument in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root, where Chromium's sandbox cannot start
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
        # No internet: any request not to loopback goes to a dead proxy, and no host name resolves.
        "--proxy-server=http://127.0.0.1:9",
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-features=Translate,OptimizationHints,MediaRouter",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    service = Service(
        executable_path=driver_path,
        log_output=str(tmp_path_factory.mktemp("chromedriver") / "chromedriver.log"),
    )
    driver = webdriver.Chrome(service=service, options=options)
    try:
        yield driver
    finally:
        driver.quit()


def requested_urls(driver: Any) -> list[str]:
    """Every network URL the browser asked for since the last call (Chrome's performance log).

    Only http(s) and ws(s) URLs count: Chromium's own start page, which a browser just started may
    still be loading (``chrome://`` and ``data:`` resources), never leaves the browser."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
        elif message["method"] == "Network.webSocketCreated":
            urls.append(message["params"]["url"])
    return [url for url in urls if url.split(":", 1)[0] in ("http", "https", "ws", "wss")]


@pytest.fixture
def screenshot_dir(tmp_path: Path) -> Path:
    """Where a test saves its screenshots: pytest's temporary folder for the test."""
    return tmp_path

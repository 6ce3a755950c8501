"""The playground page as a test sees it: real clicks and key presses on the real elements."""

from __future__ import annotations

import time
from typing import Any

from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

# Generous: on a loaded two-core machine the first token of the default model can take a minute.
ANSWER_TIMEOUT_S = 240.0


class Playground:
    """One loaded playground page in ``driver``."""

    def __init__(self, driver: Any, base_url: str, path: str = "/playground") -> None:
        self.driver = driver
        self.base_url = base_url
        driver.get(base_url + path)

    def wait(self, condition: Any, timeout: float = ANSWER_TIMEOUT_S, message: str = "") -> Any:
        return WebDriverWait(self.driver, timeout, poll_frequency=0.05).until(
            lambda driver: condition(), message
        )

    def by_id(self, element_id: str) -> Any:
        return self.driver.find_element(By.ID, element_id)

    def wait_for_models(self) -> list[str]:
        """The model ids in the picker, once loaded."""
        self.wait(lambda: self.by_id("model").find_elements(By.TAG_NAME, "option"), 30, "no models listed")
        return [o.get_attribute("value") for o in self.by_id("model").find_elements(By.TAG_NAME, "option")]

    def unfold(self, element_id: str) -> Any:
        """The element, after opening the settings section it is folded in (as a user would)."""
        element = self.by_id(element_id)
        self.driver.execute_script(
            "const d = arguments[0].closest('details'); if (d) d.open = true;", element
        )
        return element

    def click(self, element_id: str) -> None:
        self.unfold(element_id).click()

    def fill(self, element_id: str, value: str) -> None:
        """Types ``value`` into a field (opening the section it is folded in)."""
        field = self.unfold(element_id)
        field.clear()
        field.send_keys(value)

    def paste(self, element_id: str, value: str) -> None:
        """Puts a long text (JSON) into a field at once, as a paste would, and signals the input."""
        self.driver.execute_script(
            "const f = arguments[0]; const d = f.closest('details'); if (d) d.open = true;"
            "f.value = arguments[1]; f.dispatchEvent(new Event('input', {bubbles: true}));",
            self.by_id(element_id),
            value,
        )

    def choose(self, select_id: str, value: str) -> None:
        from selenium.webdriver.support.ui import Select

        Select(self.unfold(select_id)).select_by_value(value)

    def send(self, text: str) -> None:
        """Types a message and sends it with Ctrl+Enter, as a keyboard user would."""
        composer = self.by_id("composer")
        composer.send_keys(text)
        composer.send_keys(Keys.CONTROL, Keys.ENTER)
        self.wait(lambda: self.by_id("stop").is_enabled() or self.last_stat("end"), 30, "nothing was sent")

    def last_answer(self) -> Any:
        return self.driver.find_elements(By.CSS_SELECTOR, "#log > li.assistant")[-1]

    def answer_text(self) -> str:
        return str(
            self.driver.execute_script(
                "const a = document.querySelectorAll('#log > li.assistant .answer'); "
                "return a.length ? a[a.length - 1].textContent : '';"
            )
        )

    def last_stat(self, key: str) -> str | None:
        """The value of one figure under the last answer, or None (not shown, or not finished)."""
        found = self.driver.find_elements(
            By.CSS_SELECTOR, f"#log > li.assistant:last-child [data-stat='{key}'] dd"
        )
        return found[0].text if found else None

    def wait_until_finished(self) -> dict[str, str]:
        """Waits for the last answer's figures; returns them by key."""
        self.wait(lambda: self.last_stat("end") is not None, message="the answer did not finish")
        stats = self.last_answer().find_elements(By.CSS_SELECTOR, "[data-stat]")
        return {s.get_attribute("data-stat"): s.find_element(By.TAG_NAME, "dd").text for s in stats}

    def error_text(self) -> str:
        errors = self.last_answer().find_elements(By.CSS_SELECTOR, ".error")
        return errors[0].text if errors and errors[0].is_displayed() else ""

    def watch_growth(self, samples: int, within_s: float = ANSWER_TIMEOUT_S) -> list[int]:
        """Polls the streaming answer's length until it grew ``samples`` times; returns the lengths."""
        lengths = [len(self.answer_text())]
        end = time.monotonic() + within_s
        while len(lengths) <= samples and time.monotonic() < end:
            time.sleep(0.05)
            length = len(self.answer_text())
            if length != lengths[-1]:
                lengths.append(length)
        return lengths

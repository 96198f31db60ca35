"""HTML outputs of code cells go through nh3 (Ammonia): formatting and tables stay, anything that runs is gone."""

from __future__ import annotations

import pytest

from modules.notebook.render import sanitize_html


@pytest.mark.parametrize(
    "attack",
    [
        '<img src=x onerror="alert(1)">',
        '<a href="javascript:alert(1)">x</a>',
        '<div onmouseover="alert(1)">x</div>',
        "<svg><script>alert(1)</script></svg>",
        "<!--<script>alert(1)</script>-->",
        "<table><tr><td><style>*{x:expression(alert(1))}</style>x</td></tr></table>",
        "<math><mtext><table><mglyph><style><img src=x onerror=alert(1)>",
        '<iframe srcdoc="<script>alert(1)</script>"></iframe>',
        "<scr<script>ipt>alert(1)</script>",
    ],
)
def test_nothing_that_runs_survives(attack: str) -> None:
    shown = sanitize_html(attack).lower()
    for bad in ("<script", "onerror", "onclick=", "onmouseover", "javascript:", "<iframe", "<style", "<img", "<svg"):
        assert bad not in shown, (attack, shown)


def test_a_quote_inside_an_attribute_stays_inside_it() -> None:
    assert sanitize_html('<p title="x&quot; onclick=&quot;alert(1)">x</p>') == (
        '<p title="x&quot; onclick=&quot;alert(1)">x</p>'
    )


def test_tables_and_formatting_stay() -> None:
    table = '<table class="dataframe" border="1"><thead><tr><th scope="col">a</th></tr></thead><tbody><tr><td>1</td></tr></tbody></table>'
    assert sanitize_html(table) == table
    assert sanitize_html("<b>bold</b> &amp; <i>it</i><br>") == "<b>bold</b> &amp; <i>it</i><br>"
    assert sanitize_html("<p>unclosed") == "<p>unclosed</p>"

"""A request-supplied chat template cannot allocate much: every operation that could build a
string or a list far larger than its inputs is refused, from the sizes of its inputs, before it
runs (`lifeline.chat.guards`, `lifeline.chat.sizes`), and what a render builds is added up."""
from __future__ import annotations

import json
import pprint
import tracemalloc

import pytest

from lifeline.chat import ChatTemplate, RenderLimits, TemplateTimeout
from lifeline.chat.sizes import json_length, pformat_length, str_length

USER = [{"role": "user", "content": "Hi"}]
PEAK_BYTES = 50 << 20
DAG = ("{% set a = ['x' * 1000] * 1000 %}{% set b = [a] * 1000 %}{% set c = [b] * 1000 %}"
       "{% set d = {'k': c, 'n': none} %}")
"""Three lists of 1,000 references each: a few kilobytes in memory, 10**12 characters written."""

VECTORS = {
    # format widths, in total
    "%*s widths": "{{ '%*s%*s%*s%*s%*s%*s%*s%*s%*s%*s' % (7000000, 'x', 7000000, 'x', "
                  "7000000, 'x', 7000000, 'x', 7000000, 'x', 7000000, 'x', 7000000, 'x', "
                  "7000000, 'x', 7000000, 'x', 7000000, 'x') }}",
    "% widths written": "{{ ('%7000000s' * 10) % (('x',) * 10) }}",
    "% precision": "{{ ('%.7000000f' * 3) % (1.0, 2.0, 3.0) }}",
    "str.format widths": "{{ ('{:>7999999}' * 5).format(1, 2, 3, 4, 5) }}",
    "str.format one width": "{{ '{:>99999999}'.format(1) }}",
    "str.format nested width": "{{ '{:{}}{:{}}'.format('x', 7000000, 'y', 7000000) }}",
    "str.format repeated field": "{% set s = 'x' * 3000000 %}{{ '{0}{0}{0}{0}'.format(s) }}",
    "format_map": "{% set s = 'x' * 3000000 %}{{ '{a}{a}{a}{a}'.format_map({'a': s}) }}",
    "format filter": "{{ ('%7999999s' * 5)|format(1, 2, 3, 4, 5) }}",
    "% of a dict": "{% set s = 'x' * 3000000 %}{{ '%(a)s%(a)s%(a)s' % {'a': s} }}",
    # repetition and concatenation
    "str repeat": "{{ 'a' * 10**9 }}",
    "list repeat": "{{ ([1] * 10**8)|length }}",
    "str plus str": "{% set s = 'x' * 5000000 %}{{ (s + s)|length }}",
    "list plus list": "{% set l = [1] * 900000 %}{{ (l + l)|length }}",
    "concat": "{% set s = 'x' * 5000000 %}{{ (s ~ s)|length }}",
    "concat in a loop": "{% set ns = namespace(s='') %}{% for i in range(100000) %}"
                        "{% set ns.s = ns.s ~ ('x' * 100000) %}{% endfor %}",
    "int squaring": "{% set ns = namespace(x=10**100000) %}{% for i in range(30) %}"
                    "{% set ns.x = ns.x * ns.x %}{% endfor %}",
    # joins
    "join of shared strings": "{{ (['x' * 1000000] * 100)|join }}",
    "join of an iterator": "{{ (['x' * 1000000] * 100)|map('string')|join }}",
    "join with a long separator": "{{ range(100000)|join(',' * 1000) }}",
    "str.join": "{{ ('x' * 1000000).join(['a'] * 100) }}",
    # written out: a small DAG, a huge text
    "tojson of a DAG": DAG + "{{ d|tojson }}",
    "tojson indented": "{% set a = [[[[[[[[1]]]]]]]] * 100000 %}{{ a|tojson(indent=100) }}",
    "string of a DAG": DAG + "{{ c|string }}",
    "pprint of a DAG": DAG + "{{ c|pprint }}",
    "output of a DAG": DAG + "{{ c }}",
    "concat of a DAG": DAG + "{{ c ~ '' }}",
    "% of a DAG": DAG + "{{ '%s' % (c,) }}",
    "str.format of a DAG": DAG + "{{ '{}'.format(c) }}",
    "center of a DAG": DAG + "{{ c|center(10) }}",
    "upper of a DAG": DAG + "{{ c|upper }}",
    "replace in a DAG": DAG + "{{ c|replace('x', 'y') }}",
    "namespace of a DAG": DAG + "{% set ns = namespace(v=c) %}{{ ns }}",
    "dict items of a DAG": DAG + "{{ d.items() }}",
    # text filters
    "center": "{{ 'x'|center(10**12) }}",
    "indent": "{{ ('\\n' * 1000000)|indent(100) }}",
    "indent by a string": "{{ ('\\n' * 100000)|indent('x' * 1000) }}",
    "wordwrap with a long wrapstring": "{{ ('a ' * 100000)|wordwrap(1, wrapstring='x' * 100) }}",
    "wordwrap of many words": "{{ ('a ' * 3000000)|wordwrap(5) }}",
    "escape": "{{ ('\"' * 4000000)|e }}",
    "urlencode": "{{ ('\u00e9' * 1000000)|urlencode }}",
    "upper": "{{ ('\u00df' * 4000000)|upper }}",
    "str.upper": "{{ ('\ufb03' * 3000000).upper() }}",
    "title of many words": "{{ ('a ' * 3000000)|title }}",
    "xmlattr": "{{ {'a': '\"' * 2000000}|xmlattr }}",
    # lists
    "range": "{{ range(10**7)|list|length }}",
    "list of a string": "{{ ('x' * 5000000)|list|length }}",
    "str.split": "{{ ('a ' * 3000000).split()|length }}",
    "str.split at ASCII separators": "{{ ('ab\x1c' * 2500000).split()|length }}",
    "str.splitlines": "{{ ('\\n' * 3000000).splitlines()|length }}",
    "batch": "{{ [1]|batch(5000000, 'x')|list|length }}",
    "slice": "{{ [1]|slice(10**6)|list|length }}",
    "sum of lists": "{{ ([[1] * 1000] * 10000)|sum(start=[])|length }}",
    "lipsum": "{{ lipsum(10**6) }}",
    # helpers whose output the format decides
    "strftime_now of many directives": "{{ strftime_now('%c' * 2000000) }}",
    "strftime_now of wide directives": "{{ strftime_now('%7000000Y' * 20) }}",
    "str.encode with names": "{{ ('\u00e9' * 2000000).encode('ascii', 'namereplace') }}",
    "str.translate by a list": "{{ ('\x00' * 1000000).translate(['x' * 100]) }}",
    "urlize with a long target": "{{ ('www.a.com ' * 50000)|urlize(target='x' * 2000) }}",
    # bytes, as str
    "bytes repeat": "{{ 'x'.encode() * 10**8 }}",
    "bytes center": "{{ 'x'.encode().center(10**8) }}",
    "bytes % width": "{{ '%100000000d'.encode() % 1 }}",
    "bytes expandtabs": "{{ ('\t'.encode() * 1000000).expandtabs(100) }}",
    "bytes replace": "{{ ('a'.encode() * 1000000).replace('a'.encode(), 'b'.encode() * 100) }}",
}


def peak_of(template: ChatTemplate) -> tuple[TemplateTimeout, int]:
    tracemalloc.start()
    try:
        with pytest.raises(TemplateTimeout) as err:
            template.render(USER)
        return err.value, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("name", sorted(VECTORS))
def test_an_oversized_operation_fails_before_it_allocates(name):
    template = ChatTemplate(VECTORS[name], "request")
    error, peak = peak_of(template)
    assert error.param == "chat_template"
    assert peak < PEAK_BYTES, f"{name}: {peak >> 20} MiB"


KEPT_ALIVE = {
    "concatenated": "{% set ns = namespace(l=[]) %}{% for i in range(1000) %}"
                    "{% set ns.l = ns.l + [('x' * 4000000) ~ i] %}{% endfor %}",
    "sliced": "{% set s = 'x' * 4000000 %}{% set ns = namespace(l=[]) %}"
              "{% for i in range(1000) %}{% set ns.l = ns.l + [s[i:]] %}{% endfor %}",
    "stripped": "{% set s = ' ' + 'x' * 4000000 %}{% set ns = namespace(l=[]) %}"
                "{% for i in range(1000) %}{% set ns.l = ns.l + [s.strip()] %}{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(KEPT_ALIVE))
def test_results_kept_alive_count_toward_the_allocation_limit(name):
    # each string is within the size limit; together they are not
    source = KEPT_ALIVE[name]
    template = ChatTemplate(source, "request", limits=RenderLimits(max_alloc_bytes=32 << 20))
    error, peak = peak_of(template)
    assert "bytes" in str(error) and peak < PEAK_BYTES
    with pytest.raises(TemplateTimeout, match="bytes"):
        ChatTemplate(source, "request").render(USER)


def test_the_error_is_the_requests_400(tmp_path):
    from lifeline.chat import ChatError

    with pytest.raises(ChatError) as err:
        ChatTemplate(VECTORS["tojson of a DAG"], "request").render(USER)
    assert err.value.param == "chat_template" and "size" in str(err.value)


SMALL = {
    "tojson": "{{ messages|tojson }}|{{ messages|tojson(indent=2) }}"
              "|{{ messages|tojson(ensure_ascii=True) }}",
    "string and pprint": "{{ messages|string }}|{{ messages|pprint }}|{{ messages }}",
    "format": "{{ '%5s|%-3d|%.2f' % ('a', 7, 3.14159) }}|{{ '{:>6}{}'.format('b', 1) }}"
              "|{{ '%s and %s'|format('x', 'y') }}",
    "text filters": "{{ 'a\\nb'|indent(2, first=True) }}|{{ 'x'|center(5) }}"
                    "|{{ 'one two three'|wordwrap(4) }}|{{ range(5)|join(',') }}|{{ 'ab' * 3 }}",
    "concat": "{% set ns = namespace(s='') %}{% for m in messages %}"
              "{% set ns.s = ns.s ~ m.content ~ '\\n' %}{% endfor %}{{ ns.s }}",
    "bytes and links": "{{ 'ab'.encode().center(6) }}|{{ ('%3d' % 7).encode() * 2 }}"
                       "|{{ 'see www.example.com now'|urlize(target='_blank') }}"
                       "|{{ 'caf\u00e9'.encode('ascii', 'namereplace') }}"
                       "|{{ 'abc'.translate({97: 'xy'}) }}|{{ 'ab'.encode().hex(':') }}",
}
MESSAGES = [{"role": "user", "content": "caf\u00e9 \"quoted\"\n\ttab \U0001f999"},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "x" * 5000}]


@pytest.mark.parametrize("name", sorted(SMALL))
def test_ordinary_operations_render_as_transformers_does(name):
    from transformers.utils.chat_template_utils import render_jinja_template

    expected, _ = render_jinja_template([MESSAGES], chat_template=SMALL[name])
    assert ChatTemplate(SMALL[name], "request").render(MESSAGES) == expected[0]


NESTED = [[], {}, "a\nb'\"\\", ["x", 1, None, True, 2.5, {"a": [1, 2, {"b": "\u00fc\u2028\x01"}]}],
          ("t",), {"k": list(range(100))}, "\U0001f600" * 3, [["x" * 50] * 5] * 5]


def test_a_date_format_renders_the_date():
    from datetime import datetime

    before = datetime.now().strftime("%Y-%m-%d %c")
    out = ChatTemplate("{{ strftime_now('%Y-%m-%d %c') }}", "request").render(USER)
    after = datetime.now().strftime("%Y-%m-%d %c")
    assert out in (before, after)


@pytest.mark.parametrize("value", NESTED, ids=range(len(NESTED)))
def test_size_bounds_are_never_below_the_written_length(value):
    assert len(str(value)) <= str_length(value)
    assert len(pprint.pformat(value)) <= pformat_length(value)
    for ensure_ascii in (False, True):
        for indent in (None, 0, 2, "\t"):
            for separators in (None, (",", ":")):
                written = json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                                     separators=separators)
                assert len(written) <= json_length(value, ensure_ascii=ensure_ascii,
                                                   indent=indent, separators=separators)

"""The landing page's reading path (distlab.infra.reading_path): every page of the table
of contents is placed, the reading time follows its stated rule, and a page nobody
placed stops the build with a message that says where to place it."""

import pytest

from distlab.infra import reading_path as rp
from distlab.infra.landing import lab_titles
from distlab.infra.page_anatomy import unfolded_source_lines

PAGE = """---
jupytext: {}
---

# A title

one two three four

```{code-cell} ipython3
:tags: [remove-cell]
hidden words are not read
```

```{code-cell} ipython3
print("shown")
```

````{admonition} Answer
:class: dropdown
folded words
```python
x = 1
```
````

```{note}
five six
```

::::{tab-set}
:::{tab-item} CPU
seven

```bash
run
```
:::
::::
"""


def test_every_page_of_the_table_of_contents_is_on_the_path_or_a_reference():
    root, parts = rp.toc_parts()
    # raises UnclassifiedPage, naming the page and the lists to add it to
    core, reference = rp.classify(list(parts))
    assert root == "intro" and root not in core + reference
    assert core[0] == "single_device" and core[-1].startswith("labs/")
    if "launching" in parts:  # a page being written: right after collectives
        assert core[core.index("collectives") + 1] == "launching"


def test_a_page_nobody_placed_fails_with_where_to_place_it():
    pages = [*rp.CORE_PATH, *rp.REFERENCE, "new_chapter"]
    with pytest.raises(rp.UnclassifiedPage, match="new_chapter: in _toc.yml but not"):
        rp.classify(pages)
    with pytest.raises(rp.UnclassifiedPage, match="CORE_PATH .* or REFERENCE"):
        rp.classify(pages)


def test_a_placed_page_missing_from_the_toc_fails_unless_it_may_be_absent():
    pages = [p for p in [*rp.CORE_PATH, *rp.REFERENCE] if p != "launching"]
    core, _ = rp.classify(pages)  # launching is being written: left out
    assert "launching" not in core
    with pytest.raises(rp.UnclassifiedPage, match="planner: on the reading path"):
        rp.classify([p for p in pages if p != "planner"])


def test_the_core_path_keeps_its_editorial_order_whatever_the_toc_order():
    pages = list(reversed([*rp.CORE_PATH, *rp.REFERENCE]))
    core, reference = rp.classify(pages)
    assert core == list(rp.CORE_PATH)
    assert reference == [p for p in pages if p in rp.REFERENCE]  # the toc's order


def test_reading_counts_skip_folds_and_count_each_shown_block_once():
    words, blocks = rp.reading_counts(PAGE)
    # "A title", "one .. four", "five six", "seven" (the markup lines are not prose)
    assert words == 2 + 4 + 2 + 1
    assert blocks == 2  # the shown cell and the bash block in the tab
    assert rp.reading_minutes(PAGE) == 1  # at least a minute
    long = "# T\n\n" + "word " * 1000 + "\n\n```bash\nx\n```\n"
    assert rp.reading_minutes(long) == round(1002 / 200 + 0.5)


def test_a_fold_is_a_fold_to_the_reading_time_and_to_the_anatomy_alike():
    # the same folds: what the anatomy does not count, the reading time does not read
    folded = "# T\n\n````{admonition} A\n:class: dropdown\n" + "w " * 400 + "\n````\n"
    assert unfolded_source_lines(folded) == 2
    assert rp.reading_counts(folded) == (1, 0)


def test_a_cell_hidden_by_a_yaml_header_is_folded_too():
    # MyST takes a cell's options as `:tags: [...]` lines or as a `---` YAML header
    for header in (":tags: [hide-input]\n", "---\ntags: [hide-input]\n---\n"):
        page = "# T\n\n```{code-cell} ipython3\n" + header + "x = 1\n" * 40 + "```\n"
        assert unfolded_source_lines(page) == 2, header


def test_the_tables_link_each_page_and_name_each_part_once(tmp_path):
    rows = {
        "core": [rp.Row("single_device", "Baseline", "Why?", 3, "Foundations")],
        "reference": [
            rp.Row("ddp_tuning", "Flags", "Which?", 5, "Data parallelism"),
            rp.Row("ddp_scaling", "Scaling", "Will it?", 7, "Data parallelism"),
        ],
    }
    tables = rp.path_tables(rows)
    assert "| 1 | [Baseline](single_device.md) | Why? | 3 |" in tables["core"]
    assert tables["reference"].count("Data parallelism") == 1
    assert rp.total_minutes(rows["reference"]) == 12


def test_the_lab_figure_reads_the_six_labs_from_their_pages():
    labs = lab_titles()
    assert [name for name, _ in labs] == [f"lab {i}" for i in range(1, 7)]

"""A mechanism stepped through in the built page, with no kernel behind it.

The views are rendered in advance (HTML, a matplotlib figure drawn as an inline PNG, or
a tuple of both, shown one after the other) and stacked; a Play button and a slider
choose the one shown. The links between them are `jslink`s, which run in the browser, so
the built HTML steps through the views offline. (`book/_assets/widgets-setup.js` makes
the widget manager work offline; the browser test
`test_every_stepping_widget_steps_without_a_kernel` moves every one.)

    stepper([step_html(e) for e in schedule], "step")
    stepper([(caption(k), figure(k)) for k in range(steps)], "backward")
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence


def figure_html(fig, dpi: int = 90) -> str:
    """A matplotlib figure as an inline PNG that scales to the column; the figure is
    closed."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    plt.close(fig)
    data = base64.b64encode(buffer.getvalue()).decode()
    return f'<img src="data:image/png;base64,{data}" style="max-width:100%">'


def view_html(view) -> str:
    """A view as HTML: a string as is, a figure as an inline PNG, a tuple in order."""
    if isinstance(view, str):
        return view
    if isinstance(view, tuple):
        return "".join(view_html(v) for v in view)
    return figure_html(view)


def stepper(
    views: Sequence,
    label: str,
    start: int = 0,
    interval_ms: int = 1500,
    options: Sequence[str] | None = None,
):
    """``views`` (see ``view_html``) behind a Play button and a slider named ``label``,
    opening on view ``start``. With ``options`` the slider shows those names (one per
    view) instead of the view's number."""
    import ipywidgets as widgets

    if not views:
        raise ValueError("stepper() needs at least one view")
    if options is not None and len(options) != len(views):
        raise ValueError(f"{len(options)} slider options for {len(views)} views")
    last = len(views) - 1
    stack = widgets.Stack(
        [widgets.HTML(view_html(v)) for v in views], selected_index=start
    )
    play = widgets.Play(value=start, min=0, max=last, interval=interval_ms)
    if options is None:
        slider = widgets.IntSlider(value=start, min=0, max=last, description=label)
        position = "value"
    else:
        slider = widgets.SelectionSlider(
            options=[(name, i) for i, name in enumerate(options)],
            value=start,
            description=label,
        )
        position = "index"
    # links run in the browser: no Python callback
    widgets.jslink((play, "value"), (slider, position))
    widgets.jslink((slider, position), (stack, "selected_index"))
    return widgets.VBox([widgets.HBox([play, slider]), stack])

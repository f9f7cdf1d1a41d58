// Ours, not vendored: loaded after require.js and before the widget manager (embed-amd.js) on
// the pages that show ipywidgets. It fixes three things the manager does not do on its own.
(function () {
  // 1. The manager's modules find their icon fonts next to the URL RequireJS gives them,
  //    which by default is relative to the page (page-dir/@jupyter-widgets/...): a 404 on every
  //    page. Map the module names to the folder this file was served from.
  const here = document.currentScript.src.replace(/[^/]*$/, "");
  require.config({
    paths: {
      "@jupyter-widgets/html-manager/dist": here + "jupyter-widgets",
      "@jupyter-widgets": here + "jupyter-widgets",
    },
  });

  // 2. ipywidgets 8 typesets widget labels with MathJax 2's API, MathJax.Hub.Queue(...), as
  //    soon as window.MathJax exists; the book loads MathJax 3, which has no Hub, so the call
  //    throws. Whatever object becomes window.MathJax gets a Hub that calls MathJax 3.
  const hub = {
    Queue(job) {
      const mathjax = window.MathJax, element = job[2];
      if (mathjax && mathjax.startup && mathjax.startup.promise)
        mathjax.startup.promise.then(() => mathjax.typesetPromise([element]));
    },
  };
  let current = window.MathJax;
  if (current && !current.Hub) current.Hub = hub;
  Object.defineProperty(window, "MathJax", {
    configurable: true,
    get() { return current; },
    set(value) {
      if (value && typeof value === "object" && !value.Hub) value.Hub = hub;
      current = value;
    },
  });

  // 3. The theme's FontAwesome swaps every <i class="fa ..."> for an <svg>. The Play
  //    widget then finds no <i> in its button when its value changes and throws, and the
  //    throw stops the jslinks that follow (the slider no longer moves the views). Nest
  //    the svg inside the <i> instead.
  if (window.FontAwesome && window.FontAwesome.config)
    window.FontAwesome.config.autoReplaceSvg = "nest";
  else
    window.FontAwesomeConfig = Object.assign(window.FontAwesomeConfig || {}, {
      autoReplaceSvg: "nest",
    });
})();

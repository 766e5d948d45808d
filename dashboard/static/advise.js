// stagecache dashboard, /advise: draw the server-built Plotly figure (dashboard/advise_figures.py).
// The eviction-policy figure (advise --policies) is drawn the same way when the report has one.
(function () {
  "use strict";
  function draw(jsonId, divId) {
    var el = document.getElementById(jsonId);
    if (!el) return;
    var fig = JSON.parse(el.textContent);
    Plotly.newPlot(divId, fig.data, fig.layout, { displaylogo: false, responsive: true });
  }
  draw("advise-figure-json", "advise-figure");
  draw("advise-policy-figure-json", "advise-policy-figure");
})();

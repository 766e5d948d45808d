// stagecache dashboard, /advise: draw the server-built Plotly figure (dashboard/advise_figures.py).
(function () {
  "use strict";
  var el = document.getElementById("advise-figure-json");
  if (!el) return;
  var fig = JSON.parse(el.textContent);
  Plotly.newPlot("advise-figure", fig.data, fig.layout,
                 { displaylogo: false, responsive: true });
})();

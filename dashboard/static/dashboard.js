// stagecache dashboard: draw the server-built Plotly figures, then poll the live summary.
// Figures come from the server as JSON (dashboard/figures.py); this script only appends
// points (Plotly.extendTraces) and updates bars (Plotly.restyle): no page reload.
(function () {
  "use strict";
  var body = document.body;
  var pollMs = Number(body.dataset.pollMs) || 2000;
  var pageStatus = body.dataset.status;
  var MAX_POINTS = 900; // ~30 min of history at 2 s
  var plotConfig = { displaylogo: false, displayModeBar: false, responsive: true };
  var state = { polls: 0, failures: 0, live: body.dataset.live === "true", lastSummary: null };
  window.stagecacheDashboard = state; // read by the browser test and handy in devtools

  function readJson(id) {
    var el = document.getElementById(id);
    return el ? JSON.parse(el.textContent) : null;
  }

  (readJson("layer-map-figures") || []).forEach(function (fig) {
    var el = document.getElementById("layer-map-" + fig.layout.meta.stage);
    if (el) Plotly.newPlot(el, fig.data, fig.layout, plotConfig);
  });
  var liveFigures = readJson("live-figures") || {};
  Object.keys(liveFigures).forEach(function (key) {
    Plotly.newPlot("chart-" + key, liveFigures[key].data, liveFigures[key].layout, plotConfig);
  });

  function extendSeries(id, byStage, t, value) {
    var gd = document.getElementById(id);
    if (!gd || !gd.data) return;
    var idx = [], xs = [], ys = [];
    gd.data.forEach(function (trace, i) {
      var s = trace.meta && byStage[trace.meta.stage];
      if (!s) return;
      idx.push(i); xs.push([t]); ys.push([value(s, trace.meta.key)]);
    });
    if (idx.length) Plotly.extendTraces(gd, { x: xs, y: ys }, idx, MAX_POINTS);
  }

  function updateBars(id, byStage) {
    var gd = document.getElementById(id);
    if (!gd || !gd.data) return;
    var ys = gd.data.map(function (trace) {
      return (trace.customdata || []).map(function (stage) {
        var s = byStage[stage];
        return s ? s.cache_tokens[trace.meta.key] : 0;
      });
    });
    Plotly.restyle(gd, { y: ys }, gd.data.map(function (_, i) { return i; }));
  }

  function goLive() {
    state.live = true;
    Object.keys(liveFigures).forEach(function (key) {
      Plotly.relayout("chart-" + key, { annotations: [], "xaxis.showticklabels": true });
    });
    var badge = document.getElementById("live-state");
    if (badge) { badge.textContent = "live"; badge.className = "badge live"; }
  }

  function update(summary) {
    state.lastSummary = summary;
    if (pageStatus === "starting" && summary.status !== "starting") {
      window.location.reload(); // the report arrived: render table and maps once
      return;
    }
    var lv = summary.liveness;
    if (lv && lv.failure && !document.getElementById("run-failure")) {
      window.location.reload(); // a stage failed: render the failure banner (it stays until exit)
      return;
    }
    if (!summary.live) return;
    if (!state.live) goLive();
    var byStage = {};
    summary.stages.forEach(function (s) { byStage[s.stage] = s; });
    var t = summary.time * 1000;
    extendSeries("chart-hit-ratio", byStage, t, function (s) { return s.host_hit_ratio; });
    extendSeries("chart-bandwidth", byStage, t, function (s, key) {
      return s.bandwidth_bytes_per_second[key] / 1e9;
    });
    updateBars("chart-tokens", byStage);
  }

  function setPollState(text, bad) {
    var el = document.getElementById("poll-state");
    if (el) { el.textContent = text; el.className = bad ? "badge failed" : "muted"; }
  }

  function poll() {
    fetch("api/metrics/summary", { cache: "no-store" })
      .then(function (r) {
        if (!r.ok) return r.json().then(function (b) { throw new Error(r.status + ": " + b.detail); });
        return r.json();
      })
      .then(function (summary) {
        state.polls += 1;
        update(summary);
        setPollState("updated " + new Date().toLocaleTimeString(), false);
      })
      .catch(function (err) {
        state.failures += 1;
        setPollState("live numbers unavailable: " + err.message, true);
      })
      .finally(function () { window.setTimeout(poll, pollMs); });
  }
  var failedAt = document.querySelector("#run-failure time.failed-at");
  if (failedAt && failedAt.dataset.unix) {
    failedAt.textContent = new Date(parseFloat(failedAt.dataset.unix) * 1000).toLocaleString();
  }
  window.setTimeout(poll, pollMs);
})();

// stagecache dashboard: draw the server-built Plotly figures, then poll the live summary.
// Figures come from the server as Plotly JSON (dashboard/figures.py, live_figures.py); this
// script only appends each poll's windowed rates (Plotly.extendTraces), restyles the bars and
// the timeline, and keeps the run badge and progress bar true: no page reload, no figure logic.
(function () {
  "use strict";
  var body = document.body;
  var pollMs = Math.min(1000, Number(body.dataset.pollMs) || 1000);
  var windowS = Number(body.dataset.windowS) || 10;
  var pageStatus = body.dataset.status;
  var MAX_POINTS = 600; // 10 min of history at 1 s
  var RATE_CHARTS = ["chart-hit-rate", "chart-transfer", "chart-bubble", "chart-miss-reasons"];
  var plotConfig = { displaylogo: false, displayModeBar: false, responsive: true };
  var POLL_TIMEOUT_MS = 10000; // a request lost on the way is given up and polling goes on
  var state = { polls: 0, failures: 0, phase: body.dataset.phase, lastSummary: null, cleared: false,
                pollMs: pollMs };
  window.stagecacheDashboard = state; // read by the browser test and handy in devtools

  function readJson(id) {
    var el = document.getElementById(id);
    return el ? JSON.parse(el.textContent) : null;
  }

  (readJson("layer-map-figures") || []).forEach(function (fig) {
    var el = document.getElementById("layer-map-" + fig.layout.meta.stage);
    if (el) Plotly.newPlot(el, fig.data, fig.layout, plotConfig);
  });
  // Chart titles are one line from the server; where the chart is narrower than its title (a
  // phone, a grid column), the title is broken into lines that fit and the top margin grows to
  // hold them, so no title is ever cut by the chart's edge.  Runs after every poll and resize.
  var measure = document.createElement("canvas").getContext("2d");
  function fitTitle(gd) {
    var fl = gd._fullLayout, t = gd.layout && gd.layout.title;
    var text = typeof t === "string" ? t : t && t.text;
    if (!fl || !text || !gd.clientWidth) return;
    if (gd.dataset.title === undefined) {
      gd.dataset.title = text;
      gd.dataset.marginTop = fl.margin.t;
    }
    var font = fl.title.font;
    measure.font = font.size + "px " + font.family;
    var avail = gd.clientWidth - 24, lines = [], line = "";
    gd.dataset.title.split(/\s+|<br>/).forEach(function (word) {
      var next = line ? line + " " + word : word;
      if (line && measure.measureText(next).width > avail) { lines.push(line); line = word; } else { line = next; }
    });
    lines.push(line);
    var wrapped = lines.join("<br>");
    if (wrapped === text) return;
    var top = Number(gd.dataset.marginTop) + (lines.length - 1) * Math.ceil(font.size * 1.3);
    Plotly.relayout(gd, { "title.text": wrapped, "margin.t": top });
  }
  function fitTitles() {
    document.querySelectorAll(".js-plotly-plot").forEach(fitTitle);
  }
  window.stagecacheFitTitles = fitTitles;
  var resizing = null;
  window.addEventListener("resize", function () {
    window.clearTimeout(resizing);
    resizing = window.setTimeout(fitTitles, 150); // after plotly's own responsive resize
  });
  window.addEventListener("load", fitTitles);

  var liveFigures = readJson("live-figures") || {};
  Object.keys(liveFigures).forEach(function (key) {
    Plotly.newPlot("chart-" + key, liveFigures[key].data, liveFigures[key].layout, plotConfig);
  });

  function chart(id) {
    var gd = document.getElementById(id);
    return gd && gd.data ? gd : null;
  }

  function pick(r, key) { // a StageRates field, or a dotted path into one (miss_reasons.never_seen)
    return key.split(".").reduce(function (v, k) { return v === null || v === undefined ? null : v[k]; }, r);
  }

  function extendRates(id, byStage, t) {
    var gd = chart(id);
    if (!gd) return;
    var idx = [], xs = [], ys = [];
    gd.data.forEach(function (trace, i) {
      var r = trace.meta && byStage[trace.meta.stage];
      if (!r) return;
      idx.push(i); xs.push([t]); ys.push([pick(r, trace.meta.key)]);
    });
    if (idx.length) Plotly.extendTraces(gd, { x: xs, y: ys }, idx, MAX_POINTS);
  }

  function updateBars(id, byStage) {
    var gd = chart(id);
    if (!gd) return;
    var ys = gd.data.map(function (trace) {
      return (trace.customdata || []).map(function (stage, j) {
        var r = byStage[stage];
        var key = trace.meta.keys ? trace.meta.keys[j] : trace.meta.key; // per-point keys: one bar each
        return r ? r[key] : null;
      });
    });
    Plotly.restyle(gd, { y: ys }, gd.data.map(function (_, i) { return i; }));
  }

  function updateTimeline(stages) {
    var gd = chart("chart-timeline");
    if (!gd) return;
    var data = gd.data.map(function (trace) {
      var base = [], len = [], rows = [], mbs = [];
      stages.forEach(function (s) {
        (s.timeline || []).forEach(function (e) {
          if (e.kind !== trace.meta.kind) return;
          base.push(e.start * 1000); len.push(e.seconds * 1000);
          rows.push("stage " + s.stage); mbs.push(e.micro_batch);
        });
      });
      return Object.assign({}, trace, { base: base, x: len, y: rows, customdata: mbs });
    });
    // Plotly.react, not restyle: restyling `base` makes plotly re-guess the axis type (linear)
    gd.layout.xaxis.type = "date";
    Plotly.react(gd, data, gd.layout, plotConfig);
  }

  // a stage's gaps (unreachable, stale, crashed: summary.outages) shaded on the rate charts and
  // the timeline; while a stage is unreachable its rates are null, so its lines break there
  function outageShapes(outages, now) {
    return (outages || []).map(function (o) {
      return { type: "rect", xref: "x", yref: "paper", y0: 0, y1: 1, layer: "below", line: { width: 0 },
               x0: o.start * 1000, x1: (o.end || now) * 1000, name: "stage " + o.stage + " " + o.state,
               fillcolor: o.state === "crashed" ? "rgba(200,40,40,0.15)" : "rgba(230,150,0,0.18)" };
    });
  }

  function shadeOutages(summary) {
    var shapes = outageShapes(summary.outages, summary.time);
    RATE_CHARTS.concat(["chart-timeline"]).forEach(function (id) {
      var gd = chart(id);
      if (!gd || (!shapes.length && !(gd.layout.shapes || []).length)) return;
      Plotly.relayout(gd, { shapes: shapes });
    });
  }

  function updateRun(run) {
    state.phase = run.phase;
    var badge = document.getElementById("live-state");
    if (badge) {
      badge.textContent = run.live ? "live · " + run.phase
        : run.phase === "preflight" ? "preflight view" : run.phase;
      badge.className = "badge " + (run.live ? "live" : run.phase);
      badge.dataset.phase = run.phase;
    }
    var box = document.getElementById("run-progress-box");
    if (box) {
      box.hidden = run.progress === null;
      document.getElementById("run-progress").value = run.progress || 0;
      document.getElementById("run-progress-text").textContent =
        Math.round((run.progress || 0) * 100) + "%";
    }
    var detail = document.getElementById("run-detail");
    if (detail) {
      detail.textContent = run.detail;
      detail.className = "muted" + (run.phase === "failed" ? " error-text" : "");
    }
  }

  function clearEmptyState() {
    state.cleared = true;
    Object.keys(liveFigures).forEach(function (key) {
      var meta = liveFigures[key].layout.meta, update = { annotations: [] };
      update[((meta && meta.tick_axis) || "xaxis") + ".showticklabels"] = true; // subplots: the bottom axis
      Plotly.relayout("chart-" + key, update);
    });
  }

  function update(summary) {
    state.lastSummary = summary;
    document.dispatchEvent(new CustomEvent("stagecache:summary", { detail: summary })); // occupancy.js
    if (pageStatus === "starting" && summary.status !== "starting") {
      window.location.reload(); // the report arrived: render table and maps once
      return;
    }
    var lv = summary.liveness;
    if (lv && lv.failure && !document.getElementById("run-failure")) {
      window.location.reload(); // a stage failed: render the failure banner (it stays until exit)
      return;
    }
    updateRun(summary.run);
    if (!summary.has_live_numbers) return;
    if (!state.cleared) clearEmptyState();
    var byStage = {};
    summary.rates.forEach(function (r) { byStage[r.stage] = r; });
    RATE_CHARTS.forEach(function (id) { extendRates(id, byStage, summary.time * 1000); });
    updateBars("chart-tokens", byStage);
    updateBars("chart-transfer-split", byStage);
    updateTimeline(summary.stages);
    shadeOutages(summary);
  }

  function setPollState(text, bad) {
    var el = document.getElementById("poll-state");
    if (el) { el.textContent = text; el.className = bad ? "badge failed" : "muted"; }
  }

  function poll() {
    var started = Date.now(); // the next poll starts pollMs after this one started, not after it ended
    var abort = new AbortController();
    var timer = window.setTimeout(function () { abort.abort(); }, POLL_TIMEOUT_MS);
    fetch("api/metrics/summary?window=" + windowS, { cache: "no-store", signal: abort.signal })
      .then(function (r) {
        if (!r.ok) return r.json().then(function (b) { throw new Error(r.status + ": " + b.detail); });
        return r.json();
      })
      .then(function (summary) {
        state.polls += 1;
        update(summary);
        fitTitles();
        setPollState("updated " + new Date().toLocaleTimeString(), false);
      })
      .catch(function (err) {
        state.failures += 1;
        var why = err.name === "AbortError" ? "no answer within " + POLL_TIMEOUT_MS / 1000 + " s" : err.message;
        setPollState("live numbers unavailable: " + why, true);
      })
      .finally(function () {
        window.clearTimeout(timer);
        window.setTimeout(poll, Math.max(0, pollMs - (Date.now() - started)));
      });
  }
  var failedAt = document.querySelector("#run-failure time.failed-at");
  if (failedAt && failedAt.dataset.unix) {
    failedAt.textContent = new Date(parseFloat(failedAt.dataset.unix) * 1000).toLocaleString();
  }
  window.setTimeout(poll, pollMs);
})();

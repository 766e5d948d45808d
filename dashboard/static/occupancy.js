// stagecache dashboard: the host-tier table and the pool-occupancy heatmap.
// Drawn from the server's figure (dashboard/occupancy_figures.py), then refilled from every
// /api/metrics/summary poll that dashboard.js announces ("stagecache:summary"): no poll of its own.
(function () {
  "use strict";
  var plotConfig = { displaylogo: false, displayModeBar: false, responsive: true };
  var CLASS = { exceeds_ram: "bad", smaller_than_device: "warn", pin_refused: "warn", ok: "ok" };
  var state = { updates: 0 };
  window.stagecacheOccupancy = state; // read by the browser test

  var el = document.getElementById("occupancy-figure");
  var fig = el ? JSON.parse(el.textContent) : null;
  var gd = document.getElementById("chart-occupancy");
  if (fig && gd) Plotly.newPlot(gd, fig.data, fig.layout, plotConfig);

  function bytes(n) {
    if (n === null || n === undefined) return "?";
    var units = ["B", "KiB", "MiB", "GiB", "TiB"], i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return i ? n.toFixed(1) + " " + units[i] : n + " B";
  }

  function worst(status) {
    var classes = status.map(function (s) { return CLASS[s] || "warn"; });
    return ["bad", "warn", "ok"].find(function (c) { return classes.indexOf(c) >= 0; }) || "unknown";
  }

  function fill(row, cells) { // CSS class of a cell -> its text
    Object.keys(cells).forEach(function (cls) { row.querySelector("." + cls).textContent = cells[cls]; });
  }

  function updateTable(stages) {
    stages.forEach(function (s) {
      var row = document.querySelector('#host-tier-table tr[data-stage="' + s.stage + '"]');
      var t = s.host_tier;
      if (!row || !t || !t.status.length) return;
      row.querySelector(".host-tier-status").className = "host-tier-status " + worst(t.status);
      fill(row, { "host-tier-status": t.status.join(", "), "host-tier-pinned": t.pinned ? "yes" : "no",
                  "host-tier-available": bytes(t.mem_available_bytes), "host-tier-reserve": bytes(t.reserve_bytes),
                  "host-tier-reasons": t.reasons.filter(function (_, i) { return t.status[i] !== "ok"; }).join("; ") });
    });
  }

  function updateL3(stages) {
    stages.forEach(function (s) {
      var row = document.querySelector('#l3-table tr[data-stage="' + s.stage + '"]');
      var t = s.l3;
      if (!row || !t || t.backend === "none") return;
      row.querySelector(".l3-state").className = "l3-state " + (t.up ? "ok" : "warn");
      fill(row, { "l3-state": t.up ? "up" : "down", "l3-backend": t.backend, "l3-used": bytes(t.used_bytes),
                  "l3-capacity": t.capacity_bytes ? bytes(t.capacity_bytes) : "backend's",
                  "l3-prefetched": t.prefetched_tokens, "l3-backuped": t.backuped_tokens,
                  "l3-errors": Object.keys(t.errors).reduce(function (n, k) { return n + t.errors[k]; }, 0),
                  "l3-fallback": t.fallback_pages, "l3-reason": t.down_reason || "" });
    });
  }

  function updateHeatmap(stages) {
    if (!gd || !gd.data || !gd.layout.meta) return;
    var meta = gd.layout.meta, byStage = {}, seen = {};
    stages.forEach(function (s) {
      var m = {};
      (s.pool_occupancy || []).forEach(function (o) { m[o.pool + "/" + o.tier] = o; seen[o.pool + "/" + o.tier] = 1; });
      byStage[s.stage] = m;
    });
    if (!meta.rows.length) { // drawn before any stage reported: rows and columns from the data
      meta.rows = meta.order.filter(function (r) { return seen[r[0] + "/" + r[1]]; });
      if (!meta.rows.length) return;
      if (!meta.stages.length) meta.stages = stages.map(function (s) { return s.stage; });
      gd.style.height = (140 + 26 * meta.rows.length) + "px";
      Plotly.relayout(gd, { annotations: [], height: 140 + 26 * meta.rows.length });
      Plotly.restyle(gd, {
        y: [meta.rows.map(function (r) { return (meta.labels[r[0]] || r[0]) + " · " + r[1]; })],
        x: [meta.stages.map(function (k) { return "stage " + k; })] }, [0]);
    }
    var z = [], text = [];
    meta.rows.forEach(function (row) {
      var zs = [], ts = [];
      meta.stages.forEach(function (k) {
        var o = (byStage[k] || {})[row[0] + "/" + row[1]];
        zs.push(o ? (o.capacity ? o.used / o.capacity : 0) : null);
        ts.push(o ? o.used + "/" + o.capacity + (o.unit === "slot" ? " slots" : "") : "");
      });
      z.push(zs); text.push(ts);
    });
    Plotly.restyle(gd, { z: [z], text: [text] }, [0]);
  }

  document.addEventListener("stagecache:summary", function (ev) {
    var stages = ev.detail.stages || [];
    if (!stages.length) return;
    updateTable(stages);
    updateL3(stages);
    updateHeatmap(stages);
    state.updates += 1;
  });
})();

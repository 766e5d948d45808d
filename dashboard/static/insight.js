// stagecache dashboard: the stage-agreement panel (counts per stage and kind, recent disagreements).
// Rendered by the server (dashboard/insight_figures.py agreement_view), then refilled from every
// /api/metrics/summary poll that dashboard.js announces ("stagecache:summary"): no poll of its own.
// The miss-reasons chart is a rate chart: dashboard.js extends it like the others.
(function () {
  "use strict";
  var SHOWN = 20; // = insight_figures.SHOWN_DISAGREEMENTS
  var state = { updates: 0, total: null };
  window.stagecacheInsight = state; // read by the browser test

  function setText(id, text) {
    var el = document.getElementById(id);
    if (el) el.textContent = text;
  }

  function cell(text) {
    var td = document.createElement("td");
    td.textContent = text;
    return td;
  }

  function updateCounts(stages, limit) {
    var total = 0, compared = null;
    stages.forEach(function (s) {
      var counts = (s.agreement && s.agreement.disagreements) || {};
      var row = document.querySelector('#agreement-kinds tr[data-stage="' + s.stage + '"]');
      Object.keys(counts).forEach(function (kind) {
        total += counts[kind];
        var td = row && row.querySelector('td[data-kind="' + kind + '"]');
        if (td) { td.textContent = counts[kind]; td.className = "agreement-kind" + (counts[kind] ? " bad" : ""); }
      });
      var n = s.agreement ? s.agreement.compared_requests : 0;
      compared = compared === null ? n : Math.min(compared, n);
    });
    state.total = total;
    setText("agreement-total", total);
    setText("agreement-compared", compared || 0);
    setText("agreement-threshold", limit === null || limit === undefined ? "-" : limit);
    var box = document.getElementById("stage-agreement");
    if (box) box.className = (limit !== null && limit !== undefined && total > limit) ? "bad" : total ? "warn" : "ok";
  }

  function updateRecent(stages) {
    var body = document.querySelector("#agreement-table tbody");
    if (!body) return;
    var recent = [];
    stages.forEach(function (s) { recent = recent.concat((s.agreement && s.agreement.recent) || []); });
    recent.sort(function (a, b) { return b.time - a.time; });
    body.textContent = "";
    recent.slice(0, SHOWN).forEach(function (r) {
      var tr = document.createElement("tr");
      tr.className = "disagreement";
      [new Date(r.time * 1000).toLocaleTimeString(), r.micro_batch, r.request, r.kind,
       r.stages.join(", "), r.agreed, r.values.join(" / ")].forEach(function (v) { tr.appendChild(cell(v)); });
      body.appendChild(tr);
    });
    var none = document.getElementById("agreement-none");
    if (none) none.hidden = recent.length > 0;
  }

  document.querySelectorAll("#agreement-table td[data-unix]").forEach(function (td) {
    td.textContent = new Date(parseFloat(td.dataset.unix) * 1000).toLocaleTimeString();
  });
  document.addEventListener("stagecache:summary", function (ev) {
    var summary = ev.detail;
    if (!summary.has_live_numbers) return;
    var lv = summary.liveness;
    updateCounts(summary.stages, lv ? lv.max_disagreements : null);
    updateRecent(summary.stages);
    state.updates += 1;
  });
})();

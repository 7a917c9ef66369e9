/* Live statistics: polls api/stats about once a second and renders cards, bars and charts.
   Every number shown also sits, raw, in the element's data-value attribute. */
(function () {
  "use strict";
  const $ = (id) => document.getElementById(id);
  const POLL_MS = 1000, HIDDEN_POLL_MS = 5000;
  let timer = null, inFlight = null;

  const num = (v) => (typeof v === "number" && isFinite(v) ? v : 0);
  const pct = (v) => (100 * num(v)).toFixed(1) + "%";

  function bytes(v) {
    v = num(v);
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return (i ? v.toFixed(v >= 100 ? 0 : 1) : String(Math.round(v))) + " " + units[i];
  }

  function seconds(v) {
    v = num(v);
    if (v < 1) return (1000 * v).toFixed(0) + " ms";
    if (v < 60) return v.toFixed(1) + " s";
    return duration(v);
  }

  function duration(v) {
    v = Math.floor(num(v));
    const h = Math.floor(v / 3600), m = Math.floor((v % 3600) / 60), s = v % 60;
    return (h ? h + "h " : "") + (h || m ? m + "m " : "") + s + "s";
  }

  function set(id, value, text) {
    const node = $(id);
    if (!node) return;
    node.textContent = text;
    node.dataset.value = String(num(value));
  }

  function setWidth(id, fraction) {
    const node = $(id);
    if (node) node.style.width = (100 * Math.min(Math.max(num(fraction), 0), 1)).toFixed(1) + "%";
  }

  function connection(ok, message) {
    const node = $("conn-status");
    node.dataset.state = ok ? "live" : "error";
    node.textContent = ok ? "live" : "disconnected: " + message;
  }

  function renderSpeculation(spec, requests) {
    const state = $("stat-spec-state"), detail = $("stat-spec-detail");
    const running = num(requests.running), on = num(spec.requests_on);
    if (spec.batch_auto_off) {
      state.dataset.state = "off";
      state.textContent = "off (automatic)";
      detail.textContent = "switched off for the batch: it costs more than it saves";
    } else {
      state.dataset.state = running && !on ? "off" : "on";
      state.textContent = running ? "on for " + on + " of " + running : "ready";
      detail.textContent = "k = " + num(spec.k) + (running ? " · per-request switch and automatic off" : " · idle");
    }
    state.dataset.requestsOn = String(on);
  }

  function renderMemory(memory) {
    const weights = memory.weights_bytes || {}, used = memory.kv_bytes_used || {}, cap = memory.kv_bytes_capacity || {};
    for (const model of ["target", "draft"]) {
      const row = $("mem-row-" + model);
      const present = num(weights[model]) > 0 || num(cap[model]) > 0;
      row.hidden = model === "draft" && !present;
      set("mem-weights-" + model, weights[model], bytes(weights[model]));
      const fraction = num(cap[model]) ? num(used[model]) / num(cap[model]) : 0;
      set("mem-kv-" + model, used[model], bytes(used[model]) + " / " + bytes(cap[model]) +
          " (" + (100 * fraction).toFixed(0) + "%)");
      setWidth("mem-kv-" + model + "-fill", fraction);
    }
  }

  function renderHistory(history) {
    const times = history.map((p) => num(p.t));
    const col = (key) => history.map((p) => num(p[key]));
    const css = getComputedStyle(document.documentElement);
    const color = (name) => css.getPropertyValue(name).trim() || "#3a6fd8";
    SpecCharts.line($("chart-throughput"), times, [{ values: col("tokens_per_s"), color: color("--accent") }]);
    SpecCharts.line($("chart-acceptance"), times, [{ values: col("acceptance_rate"), color: color("--accepted-line") }],
                    { max: 1, percent: true });
    SpecCharts.line($("chart-mal"), times, [{ values: col("mean_accepted_length"), color: color("--draft") }]);
    SpecCharts.line($("chart-queue"), times, [{ values: col("running"), color: color("--running") },
                                              { values: col("waiting"), color: color("--waiting") }]);
  }

  function renderReplicas(replicas) {
    // `specdecode serve --replicas N`: one row per engine replica (absent on a single server)
    $("replicas-panel").hidden = !Array.isArray(replicas);
    if (!Array.isArray(replicas)) return;
    $("replicas-body").replaceChildren(...replicas.map((r) => {
      const row = document.createElement("tr");
      row.dataset.replica = r.replica;
      for (const text of [r.replica, num(r.throughput_tokens_per_s).toFixed(1), pct(r.acceptance_rate),
                          String(num(r.running)), String(num(r.waiting)), String(num(r.finished))]) {
        const cell = document.createElement(row.children.length ? "td" : "th");
        cell.textContent = text;
        row.appendChild(cell);
      }
      return row;
    }));
  }

  function render(stats) {
    const spec = stats.speculation || {}, requests = stats.requests || {};
    $("model-name").textContent = stats.model || "–";
    $("method-name").textContent = stats.method || "–";
    $("uptime").textContent = duration(stats.uptime_s);
    set("stat-acceptance", spec.acceptance_rate, pct(spec.acceptance_rate));
    set("stat-mal", spec.mean_accepted_length, num(spec.mean_accepted_length).toFixed(2));
    set("stat-tokens-per-step", spec.tokens_per_step, num(spec.tokens_per_step).toFixed(2));
    set("stat-throughput", stats.throughput_tokens_per_s, num(stats.throughput_tokens_per_s).toFixed(1));
    for (const key of ["running", "waiting", "finished", "failed", "aborted"]) {
      set("stat-" + key, requests[key], String(num(requests[key])));
    }
    renderSpeculation(spec, requests);
    const draft = num(spec.draft_s), verify = num(spec.verify_s), total = draft + verify;
    set("stat-draft-share", total ? draft / total : 0, total ? pct(draft / total) : "–");
    set("stat-verify-share", total ? verify / total : 0, total ? pct(verify / total) : "–");
    $("stat-draft-s").textContent = seconds(draft);
    $("stat-verify-s").textContent = seconds(verify);
    setWidth("draft-share-fill", total ? draft / total : 0);
    setWidth("verify-share-fill", total ? verify / total : 0);
    // counters some servers add to the documented schema; "–" when absent
    for (const [id, value] of [["stat-steps", spec.steps], ["stat-drafted", spec.drafted_tokens],
                               ["stat-accepted", spec.accepted_tokens], ["stat-generated", stats.generated_tokens]]) {
      set(id, value, typeof value === "number" ? value.toLocaleString("en-US") : "–");
    }
    renderMemory(stats.memory || {});
    const prefix = stats.prefix_cache;
    set("stat-prefix-hit-rate", prefix ? prefix.hit_rate : 0,
        !prefix ? "–" : prefix.enabled ? pct(prefix.hit_rate) : "off");
    set("stat-prefix-cached", prefix ? prefix.cached_bytes : 0, prefix && prefix.enabled ? bytes(prefix.cached_bytes) : "–");
    SpecCharts.bars($("chart-positions"), spec.acceptance_per_position || []);
    set("stat-tree-nodes", spec.tree_nodes_mean, typeof spec.tree_nodes_mean === "number" ? spec.tree_nodes_mean.toFixed(2) : "–");
    const tree = spec.last_tree;
    if (window.SpecTree) SpecTree.draw($("pg-tree"), tree);
    $("tree-summary").textContent = tree ? `${tree.tokens.length} nodes, ${tree.accepted.length} accepted` : "none yet";
    renderHistory(Array.isArray(stats.history) ? stats.history : []);
    renderReplicas(stats.replicas);
    document.body.dataset.statsUpdated = String(Date.now());
  }

  async function refresh() {
    if (inFlight) return inFlight;
    inFlight = (async () => {
      try {
        const response = await apiFetch("api/stats", { cache: "no-store" });
        if (!response.ok) throw new Error("HTTP " + response.status);
        render(await response.json());
        connection(true);
      } catch (err) {
        connection(false, err.message || String(err));
      } finally {
        inFlight = null;
      }
    })();
    return inFlight;
  }

  async function loop() {
    await refresh();
    timer = setTimeout(loop, document.hidden ? HIDDEN_POLL_MS : POLL_MS);
  }

  document.addEventListener("visibilitychange", () => {
    if (!document.hidden) { clearTimeout(timer); loop(); }
  });
  window.specdecodeDashboard = { refresh: refresh };
  loop();
})();

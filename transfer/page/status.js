// The rollout status page: polls the transfer's JSON API and renders it. Text goes in with
// textContent only (never as HTML). The API token, when one is set, is asked for once and
// kept in this tab's sessionStorage.
"use strict";
(function () {
  // Under node (tests/test_status_page.py) only the pure helpers, for their own test.
  if (typeof document === "undefined") {
    module.exports = { took };
    return;
  }
  const params = new URLSearchParams(location.search);
  const every = Math.max(200, Number(params.get("poll_ms")) || 2000);
  const $ = (id) => document.getElementById(id);
  let token = sessionStorage.getItem("cube-api-token") || "";

  async function api(path, options = {}) {
    const headers = Object.assign({}, options.headers || {});
    if (token) headers["Authorization"] = "Bearer " + token;
    const reply = await fetch(path, Object.assign({}, options, { headers }));
    if (reply.status === 401) {
      $("login").hidden = false;
      throw new Error("the API needs its token (api_token)");
    }
    const body = await reply.json();
    if (body.success !== "0") throw new Error(body.message || reply.statusText);
    return body.data;
  }

  function cell(row, text, cls) {
    const td = row.insertCell();
    td.textContent = text === undefined || text === null ? "" : String(text);
    if (cls) td.className = cls;
    return td;
  }

  function when(seconds) {
    return seconds ? new Date(seconds * 1000).toLocaleString() : "";
  }

  // A failed version's retries: "attempt 2 of 9", when the next one begins, or why none will.
  function attempts(record) {
    return record.attempts > 1 || record.retry_at
      ? record.attempts + " of " + record.max_attempts : "";
  }

  function retryNote(record) {
    if (record.retry_at) return "next attempt at " + when(record.retry_at);
    return record.abandoned ? "abandoned: " + record.abandoned : "";
  }

  // How long a version took, from the API's float `took` (create_time and finish_time are
  // whole seconds): "420 ms" under a second, "12.3 s" from one on; "" while in progress.
  function took(record) {
    const seconds = record.took;
    if (typeof seconds !== "number" || !(seconds >= 0)) return "";
    const ms = Math.round(seconds * 1000);
    return ms < 1000 ? ms + " ms" : seconds.toFixed(1) + " s";
  }

  function render(info, instances, history) {
    $("live").textContent = info.live_version || "none yet";
    $("since").textContent = info.live_since ? "since " + when(info.live_since) : "";
    const dep = info.deployment;
    $("rollout").hidden = !dep;
    if (dep) {
      $("rollout-version").textContent = dep.version;
      $("rollout-phase").textContent = dep.phase;
      const done = Object.entries((dep.results || {})[dep.phase] || {});
      $("rollout-detail").textContent = dep.kind + (dep.committed ? ", committed" : "") +
        "; " + (dep.targets || []).length + " instances in the rollout" +
        (done.length ? "; " + done.map(([n, r]) => n + ": " + r).join(", ") : "");
    }
    const waiting = info.awaiting_retry || [];
    $("retry").hidden = !waiting.length;
    $("retry-list").replaceChildren(...waiting.map((record) => {
      const item = document.createElement("li");
      item.dataset.version = record.version;
      item.textContent = record.version + ": attempt " + record.attempts + " of " +
        record.max_attempts + " failed (" + record.last_error + "); next attempt at " +
        when(record.retry_at);
      return item;
    }));
    const replicas = $("replicas").tBodies[0];
    replicas.replaceChildren();
    for (const inst of instances) {
      const row = replicas.insertRow();
      row.dataset.instance = inst.name;
      cell(row, inst.shard);
      cell(row, inst.replica);
      cell(row, inst.serving_version || "-", "serves");
      cell(row, inst.bg_version || "");
      cell(row, inst.status, inst.status);
      cell(row, inst.message || inst.last_failure_message || "");
    }
    // in time order, oldest first (the last 50); the live version's place in it tells an
    // older version (roll back to it) from a newer one (roll forward to it)
    const ordered = history.slice().sort((a, b) => (a.create_time || 0) - (b.create_time || 0));
    const live = ordered.findLastIndex((r) => r.version === info.live_version &&
      r.mode !== "rollback");
    // the latest record of each version: the one a retry acts on
    const latest = new Map();
    for (const record of ordered) if (record.mode !== "rollback") latest.set(record.version, record);
    const table = $("history").tBodies[0];
    table.replaceChildren();
    ordered.forEach((record, index) => {
      if (index < ordered.length - 50) return;
      const row = table.insertRow();
      row.dataset.version = record.version;
      cell(row, record.version || record.line);
      cell(row, record.mode);
      cell(row, record.status_str, record.status_str);
      cell(row, attempts(record));
      cell(row, took(record));
      cell(row, when(record.finish_time));
      cell(row, [record.message, retryNote(record)].filter(Boolean).join("; "));
      const action = row.insertCell();
      const rollbackable = record.status_str === "finished" && record.mode !== "rollback" &&
        record.version && record.version !== info.live_version;
      if (rollbackable) {
        const button = document.createElement("button");
        const forward = live >= 0 && index > live;
        button.textContent = (forward ? "Roll forward to " : "Roll back to ") + record.version;
        button.addEventListener("click", () => rollback(record.version));
        action.appendChild(button);
      }
      const retryable = record.status_str === "failed" && record.abandoned && !record.retry_at &&
        record.version && record.mode !== "rollback" && latest.get(record.version) === record;
      if (retryable) {
        const button = document.createElement("button");
        button.className = "retry";
        button.textContent = "Retry " + record.version;
        button.addEventListener("click", () => retry(record.version));
        action.appendChild(button);
      }
    });
  }

  // a POST of {version} to the API, after the user confirms it; a refusal shows its message
  async function act(path, version, question, failure) {
    if (!confirm(question)) return;
    try {
      await api(path, {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ version }),
      });
      problem("");
    } catch (error) {
      problem(failure + ": " + error.message);
    }
    refresh();
  }

  function retry(version) {
    return act("dict/retry", version, "Roll " + version + " out again?",
      "retry of " + version + " failed");
  }

  function rollback(version) {
    return act("dict/rollback", version, "Make " + version + " live on every replica?",
      "rollback to " + version + " failed");
  }

  function problem(text) {
    $("problem").hidden = !text;
    $("problem").textContent = text;
  }

  async function refresh() {
    try {
      const [info, instances, history] = await Promise.all([
        api("dict/info"), api("instance/status"), api("dict/deploy/history"),
      ]);
      render(info, instances, history);
      problem("");
    } catch (error) {
      problem(error.message);
    }
  }

  $("login").addEventListener("submit", (event) => {
    event.preventDefault();
    token = $("token").value.trim();
    sessionStorage.setItem("cube-api-token", token);
    $("login").hidden = true;
    refresh();
  });
  refresh();
  setInterval(refresh, every);
})();

/* Playground: streams a completion over server-sent events (fetch + ReadableStream) with
   return_token_kinds, and colours accepted / recovered / bonus tokens. */
(function () {
  "use strict";
  const $ = (id) => document.getElementById(id);
  const KINDS = ["accepted", "recovered", "bonus"];
  let controller = null;

  async function loadModels() {
    const select = $("pg-model");
    try {
      const response = await apiFetch("v1/models", { cache: "no-store" });
      if (!response.ok) throw new Error("HTTP " + response.status);
      const body = await response.json();
      for (const model of body.data || []) select.appendChild(new Option(model.id, model.id));
    } catch (err) {
      status("error", "could not list models: " + (err.message || err));
    }
  }

  function status(state, text) {
    const node = $("pg-status");
    node.dataset.state = state;
    node.textContent = text;
  }

  function intField(id, name, low, high) {
    const raw = $(id).value.trim();
    if (raw === "") return null;
    const value = Number(raw);
    if (!Number.isInteger(value) || value < low || (high !== null && value > high)) {
      throw new Error(name + " must be an integer " + (high !== null ? "in [" + low + ", " + high + "]" : ">= " + low) +
                      ", got " + raw);
    }
    return value;
  }

  function buildRequest() {
    const chat = $("pg-endpoint").value === "chat";
    const prompt = $("pg-prompt").value;
    if (!prompt.trim()) throw new Error("the prompt is empty");
    const temperature = Number($("pg-temperature").value || "0");
    if (!isFinite(temperature) || temperature < 0) throw new Error("temperature must be a number >= 0");
    const body = {
      model: $("pg-model").value || undefined,
      max_tokens: intField("pg-max-tokens", "max tokens", 1, null) || 64,
      temperature: temperature, stream: true, return_token_kinds: true,
      speculate: $("pg-speculate").checked,
    };
    const k = intField("pg-k", "k", 0, 32);
    if (body.speculate && k !== null) body.num_speculative_tokens = k;
    if (chat) body.messages = [{ role: "user", content: prompt }];
    else body.prompt = prompt;
    return { url: chat ? "v1/chat/completions" : "v1/completions", body: body, chat: chat };
  }

  function errorText(raw, code) {
    try {
      const body = JSON.parse(raw);
      const error = body.error || body;
      return (error.message || error.detail || raw) + " (HTTP " + code + ")";
    } catch (_) {
      return (raw || "request failed") + " (HTTP " + code + ")";
    }
  }

  /* Calls onEvent(data) for each SSE event's data; resolves when the stream ends. */
  async function readEvents(response, onEvent) {
    const reader = response.body.getReader(), decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      buffer += decoder.decode(value || new Uint8Array(), { stream: !done });
      const events = buffer.split(/\r?\n\r?\n/);
      buffer = done ? "" : events.pop();
      for (const event of events) {
        const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
        if (data.length && onEvent(data.join("\n")) === false) { reader.cancel().catch(() => {}); return; }
      }
      if (done) return;
    }
  }

  function counter() {
    const counts = { accepted: 0, recovered: 0, bonus: 0, plain: 0 };
    return {
      add(kind) { counts[kind] += 1; },
      render(ttft, elapsed) {
        for (const kind of KINDS) $("pg-count-" + kind).textContent = String(counts[kind]);
        const total = counts.accepted + counts.recovered + counts.bonus + counts.plain;
        const steps = counts.recovered + counts.bonus;   // each verify step ends with exactly one of these
        $("pg-count-total").textContent = String(total);
        $("pg-tokens-per-step").textContent = steps ? ((counts.accepted + steps) / steps).toFixed(2) : "–";
        $("pg-ttft").textContent = ttft === null ? "–" : (1000 * ttft).toFixed(0) + " ms";
        $("pg-rate").textContent = elapsed > 0 && total > 1 ? (total / elapsed).toFixed(1) + " tok/s" : "–";
        return total;
      },
    };
  }

  /* Newlines get a visible mark and control characters their Unicode pictures, so that every
     token shows its colour; the raw text stays in data-text. */
  function visible(text) {
    return text.replace(/\n/g, "\u21b5\n").replace(/[\u0000-\u0008\u000b-\u001f]/g,
                                                     (c) => String.fromCharCode(0x2400 + c.charCodeAt(0)));
  }

  function appendToken(output, text, kind) {
    const span = document.createElement("span");
    span.className = "tok tok-" + kind;
    span.dataset.kind = kind;
    span.dataset.text = text;
    span.textContent = visible(text);   // never innerHTML: the model's text is not markup
    output.appendChild(span);
  }

  async function generate(event) {
    event.preventDefault();
    if (controller) return;
    let request;
    try { request = buildRequest(); } catch (err) { status("error", err.message); return; }
    const output = $("pg-output"), counts = counter();
    output.replaceChildren();
    counts.render(null, 0);
    controller = new AbortController();
    $("pg-send").disabled = true;
    $("pg-stop").disabled = false;
    status("running", "generating…");
    const start = performance.now();
    let ttft = null, finish = null, failure = null;
    try {
      const response = await apiFetch(request.url, {
        method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify(request.body), signal: controller.signal,
      });
      if (!response.ok) throw new Error(errorText(await response.text(), response.status));
      await readEvents(response, (data) => {
        if (data === "[DONE]") return false;
        const chunk = JSON.parse(data);
        if (chunk.error) { failure = chunk.error.message || JSON.stringify(chunk.error); return false; }
        const choice = (chunk.choices || [])[0];
        if (!choice) return true;
        const text = request.chat ? (choice.delta || {}).content || "" : choice.text || "";
        const kinds = Array.isArray(choice.token_kinds) ? choice.token_kinds : null;
        if (kinds && kinds.length) {
          for (const token of kinds) {
            const kind = KINDS.includes(token.kind) ? token.kind : "plain";
            appendToken(output, token.text, kind);
            counts.add(kind);
          }
        } else if (text) {
          appendToken(output, text, "plain");
          counts.add("plain");
        }
        if ((text || (kinds && kinds.length)) && ttft === null) ttft = (performance.now() - start) / 1000;
        if (choice.finish_reason) finish = choice.finish_reason;
        counts.render(ttft, (performance.now() - start) / 1000);
        return true;
      });
      const elapsed = (performance.now() - start) / 1000;
      const total = counts.render(ttft, elapsed);
      if (failure) status("error", "server error: " + failure);
      else status("done", "done: " + total + " tokens in " + elapsed.toFixed(2) + " s" +
                  (finish ? " (finish reason: " + finish + ")" : ""));
    } catch (err) {
      if (err.name === "AbortError") status("stopped", "stopped");
      else status("error", err.message || String(err));
    } finally {
      controller = null;
      $("pg-send").disabled = false;
      $("pg-stop").disabled = true;
      if (window.specdecodeDashboard) window.specdecodeDashboard.refresh();
    }
  }

  $("pg-form").addEventListener("submit", generate);
  $("pg-stop").addEventListener("click", () => { if (controller) controller.abort(); });
  $("pg-speculate").addEventListener("change", () => { $("pg-k").disabled = !$("pg-speculate").checked; });
  loadModels();
})();

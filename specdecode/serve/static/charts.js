/* Small SVG charts for the dashboard: line charts over time and a bar chart. No dependencies. */
(function () {
  "use strict";
  const NS = "http://www.w3.org/2000/svg";
  const PAD = { left: 38, right: 8, top: 8, bottom: 18 };

  function el(name, attrs, text) {
    const node = document.createElementNS(NS, name);
    for (const key in attrs) node.setAttribute(key, attrs[key]);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function size(svg) {
    const box = svg.viewBox.baseVal;
    return { w: box && box.width ? box.width : 320, h: box && box.height ? box.height : 130 };
  }

  function niceMax(value) {
    if (!(value > 0)) return 1;
    const step = Math.pow(10, Math.floor(Math.log10(value)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * step >= value) return m * step;
    return 10 * step;
  }

  function label(value) {
    if (value >= 1000) return (value / 1000).toFixed(value >= 10000 ? 0 : 1) + "k";
    if (value >= 10 || value === 0) return String(Math.round(value));
    return value.toFixed(value >= 1 ? 1 : 2);
  }

  /* series: [{values: [number], color: css colour}], times: [seconds]; opts.max fixes the y range. */
  function line(svg, times, series, opts) {
    opts = opts || {};
    const { w, h } = size(svg);
    svg.replaceChildren();
    const x0 = PAD.left, x1 = w - PAD.right, y0 = h - PAD.bottom, y1 = PAD.top;
    if (times.length < 2) {
      svg.appendChild(el("text", { x: w / 2, y: h / 2, "text-anchor": "middle", class: "empty" }, "waiting for data…"));
      return;
    }
    let top = opts.max;
    if (top === undefined) {
      let seen = 0;
      for (const s of series) for (const v of s.values) if (v > seen) seen = v;
      top = niceMax(seen);
    }
    const t0 = times[0], t1 = times[times.length - 1], span = Math.max(t1 - t0, 1e-9);
    const px = (t) => x0 + (x1 - x0) * (t - t0) / span;
    const py = (v) => y0 - (y0 - y1) * Math.min(Math.max(v, 0), top) / top;
    for (const frac of [0, 0.5, 1]) {
      const y = py(top * frac);
      svg.appendChild(el("line", { x1: x0, x2: x1, y1: y, y2: y, class: "grid" }));
      svg.appendChild(el("text", { x: x0 - 4, y: y + 3, "text-anchor": "end", class: "axis" },
                         opts.percent ? Math.round(100 * top * frac) + "%" : label(top * frac)));
    }
    svg.appendChild(el("text", { x: x0, y: h - 4, class: "axis" }, "-" + Math.round(span) + " s"));
    svg.appendChild(el("text", { x: x1, y: h - 4, "text-anchor": "end", class: "axis" }, "now"));
    for (const s of series) {
      let d = "";
      s.values.forEach((v, i) => { d += (i ? "L" : "M") + px(times[i]).toFixed(1) + "," + py(v || 0).toFixed(1); });
      svg.appendChild(el("path", { d: d, class: "line", stroke: s.color }));
    }
  }

  /* values in [0, 1], one bar per draft position. */
  function bars(svg, values) {
    const { w, h } = size(svg);
    svg.replaceChildren();
    if (!values.length) {
      svg.appendChild(el("text", { x: w / 2, y: h / 2, "text-anchor": "middle", class: "empty" }, "no drafts yet"));
      return;
    }
    const x0 = PAD.left, x1 = w - PAD.right, y0 = h - PAD.bottom, y1 = PAD.top + 10;
    for (const frac of [0, 0.5, 1]) {
      const y = y0 - (y0 - y1) * frac;
      svg.appendChild(el("line", { x1: x0, x2: x1, y1: y, y2: y, class: "grid" }));
      svg.appendChild(el("text", { x: x0 - 4, y: y + 3, "text-anchor": "end", class: "axis" }, Math.round(frac * 100) + "%"));
    }
    const slot = (x1 - x0) / values.length, width = Math.max(2, slot * 0.7);
    values.forEach((v, i) => {
      const value = Math.min(Math.max(v || 0, 0), 1), top = y0 - (y0 - y1) * value;
      const x = x0 + slot * i + (slot - width) / 2;
      const bar = el("rect", { x: x, y: top, width: width, height: Math.max(y0 - top, 0), class: "bar" });
      bar.appendChild(el("title", {}, "position " + (i + 1) + ": " + (100 * value).toFixed(1) + "%"));
      svg.appendChild(bar);
      svg.appendChild(el("text", { x: x + width / 2, y: h - 5, "text-anchor": "middle", class: "axis" }, String(i + 1)));
      if (slot >= 18) {
        svg.appendChild(el("text", { x: x + width / 2, y: top - 3, "text-anchor": "middle", class: "barlabel" },
                           Math.round(100 * value) + "%"));
      }
    });
  }

  window.SpecCharts = { line: line, bars: bars };
})();

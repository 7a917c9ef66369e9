/* Draws the last verified draft (api/stats speculation.last_tree) as an SVG tree: the root (the
 * last committed token) on the left, one column per depth, the accepted path highlighted, the
 * rejected branches dimmed, and the step's extra token (recovered or bonus) after the path. */
(function () {
  "use strict";
  const NS = "http://www.w3.org/2000/svg";
  const COL = 92, ROW = 22, W = 84, H = 18;

  function el(name, attrs, text) {
    const node = document.createElementNS(NS, name);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function label(text) {
    const shown = JSON.stringify(text).slice(1, -1);
    return shown.length > 11 ? shown.slice(0, 10) + "…" : shown;
  }

  function draw(svg, tree) {
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    if (!tree || !Array.isArray(tree.tokens) || !tree.tokens.length) {
      svg.setAttribute("viewBox", "0 0 320 30");
      svg.appendChild(el("text", { x: 4, y: 18, class: "tree-empty" }, "no draft verified yet"));
      svg.dataset.nodes = "0";
      return;
    }
    const n = tree.tokens.length, parents = tree.parents, accepted = new Set(tree.accepted || []);
    const children = Array.from({ length: n + 1 }, () => []);        // index n = the root
    parents.forEach((p, i) => children[p < 0 ? n : p].push(i));
    const depth = new Array(n), row = new Array(n);
    let next = 0;
    (function place(node, d) {                                         // depth-first, leaves get rows
      if (node !== n) { depth[node] = d; }
      const kids = children[node];
      if (!kids.length) { row[node] = next++; return; }
      for (const c of kids) place(c, d + 1);
      row[node] = row[kids[0]];
    })(n, 0);
    const rootRow = children[n].length ? row[children[n][0]] : 0;
    const hasExtra = tree.extra_token !== null && tree.extra_token !== undefined;
    const maxDepth = Math.max(...depth) + (hasExtra ? 1 : 0);
    const rows = next + (hasExtra ? 1 : 0), width = (maxDepth + 1) * COL + W, height = rows * ROW + 8;
    svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
    svg.style.maxWidth = width * 1.4 + "px";                          // small trees stay small
    const xy = (d, r) => [4 + d * COL, 4 + r * ROW];
    const box = (x, y, text, cls, title) => {
      const g = el("g", { class: cls });
      g.appendChild(el("rect", { x, y, width: W, height: H, rx: 4 }));
      g.appendChild(el("text", { x: x + 5, y: y + 13 }, label(text)));
      g.appendChild(el("title", {}, title));
      svg.appendChild(g);
    };
    for (let i = 0; i < n; i++) {                                      // edges first, under the boxes
      const p = parents[i];
      const [x0, y0] = p < 0 ? xy(0, rootRow) : xy(depth[p], row[p]);
      const [x1, y1] = xy(depth[i], row[i]);
      const on = accepted.has(i) && (p < 0 || accepted.has(p));
      svg.appendChild(el("path", { d: `M${x0 + W} ${y0 + H / 2} C${x0 + W + 6} ${y0 + H / 2} ${x1 - 6} ${y1 + H / 2} ${x1} ${y1 + H / 2}`,
                                   class: on ? "tree-edge accepted" : "tree-edge" }));
    }
    box(...xy(0, rootRow), "root", "tree-node root", "the last committed token");
    for (let i = 0; i < n; i++) {
      const cls = accepted.has(i) ? "tree-node accepted" : "tree-node rejected";
      box(...xy(depth[i], row[i]), tree.texts[i], cls, `node ${i}: token ${tree.tokens[i]} (depth ${depth[i]})`);
    }
    if (hasExtra) {                                                    // on a row of its own, below the tree
      const path = tree.accepted || [], last = path.length ? path[path.length - 1] : -1;
      const d = last < 0 ? 1 : depth[last] + 1, r = next;
      const [x0, y0] = last < 0 ? xy(0, rootRow) : xy(depth[last], row[last]), [x1, y1] = xy(d, r);
      svg.appendChild(el("path", { d: `M${x0 + W} ${y0 + H / 2} C${x0 + W + 6} ${y0 + H / 2} ${x1 - 6} ${y1 + H / 2} ${x1} ${y1 + H / 2}`,
                                   class: "tree-edge extra" }));
      const kind = children[last < 0 ? n : last].length ? "recovered" : "bonus";   // a draft rejected there, or none
      const text = tree.emitted_texts[tree.emitted_texts.length - 1];
      box(...xy(d, r), text, "tree-node extra " + kind, `the target's own token after the accepted path (${kind})`);
      svg.dataset.extra = kind;
    }
    svg.dataset.nodes = String(n);
    svg.dataset.accepted = String(accepted.size);
  }

  window.SpecTree = { draw: draw };
})();

// The acceptance-by-position bar chart: plain SVG, no library.

const NS = "http://www.w3.org/2000/svg";

// Draw `bars` (shares in [0, 1], one per draft position) into `svg` (viewBox 0 0 320 130).
export function drawBars(svg, bars) {
  svg.replaceChildren();
  const add = (tag, attrs, text) => {
    const node = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
    if (text !== undefined) node.textContent = text;
    svg.append(node);
    return node;
  };
  const [x0, y0, width, height] = [28, 108, 284, 92];
  add("line", { class: "axis", x1: x0, y1: y0, x2: x0 + width, y2: y0 });
  add("line", { class: "axis", x1: x0, y1: y0, x2: x0, y2: y0 - height });
  for (const v of [0, 0.5, 1]) {
    add("text", { x: 2, y: y0 - v * height + 3 }, `${v * 100}%`);
  }
  const slot = width / bars.length;
  const label = [];
  bars.forEach((v, i) => {
    const h = v * height;
    const x = x0 + i * slot + slot * 0.15;
    const bar = add("rect", { class: "bar", x, y: y0 - h, width: slot * 0.7, height: h });
    const title = document.createElementNS(NS, "title");
    title.textContent = `position ${i + 1}: ${(v * 100).toFixed(0)}% accepted`;
    bar.append(title);
    add("text", { x: x + slot * 0.35, y: y0 - h - 3, "text-anchor": "middle" }, `${Math.round(v * 100)}`);
    add("text", { x: x + slot * 0.35, y: y0 + 11, "text-anchor": "middle" }, String(i + 1));
    label.push(`position ${i + 1} ${Math.round(v * 100)}%`);
  });
  add("text", { x: x0 + width / 2, y: y0 + 21, "text-anchor": "middle" }, "draft position");
  svg.setAttribute("aria-label", `acceptance by position: ${label.join(", ")}`);
  svg.dataset.bars = JSON.stringify(bars);
}
